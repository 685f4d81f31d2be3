"""bitsandbytes' 8-bit AdamW (`bitsandbytes.optim.AdamW8bit`, `PagedAdamW8bit`), its state laid out as bitsandbytes lays
it out and its update counted as bitsandbytes' kernel: for `optimizer:name=adamw8bit:impl=bitsandbytes`.

bitsandbytes is a CUDA library (not installed here); what its optimizer holds is read from its source
(bitsandbytes/optim/optimizer.py, Optimizer2State.init_state and get_state_buffer):

- a parameter of fewer than `min_8bit_size` (4096) values keeps two float32 moments (`state1`, `state2`);
- a larger one keeps two uint8 code tensors of its own shape, made with `torch.zeros_like(p, dtype=torch.uint8)`
  (PyTorch's caching allocator), and, blockwise (the default), two float32 `absmax` tensors of one value per
  **2048** values, the last block ragged (`ceil(n / 2048)`), where torchao's AdamW8bit keeps one per 256 and
  quantises only parameters whose size the block divides;
- each optimizer instance holds the two 256-value float32 quantisation maps (`name2qmap`, moved to the device on the
  first 8-bit state);
- paged (`PagedAdamW8bit`): `get_state_buffer` makes the moments of a parameter of at least 100,000 values with
  `cudaMallocManaged` (CUDA unified memory), outside the caching allocator.

The update is one CUDA kernel per parameter (`optimizer_update_8bit_blockwise`, `optimizer_update_32bit`) that reads
the gradient and updates the weight, the codes and the block maxima in place, its intermediates in registers. Here it
is emulated by PyTorch arithmetic inside `memory_categories.one_fused_kernel()`, so the trackers count no temporary:
dequantise with the old block maxima, Adam's moments in float32, the weight's decoupled decay and step from the
unrounded moments, and new block maxima and codes (nearest value of the dynamic map). The first step is AdamW's to
float rounding; later steps round the moments, as bitsandbytes does (its exact rounding is not claimed).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from bench.core.errors import Unsupported
from bench.core.memory_categories import UNIFIED_MEMORY, allocating, one_fused_kernel
from bench.core.quiet_import import import_torchao

MIN_8BIT_SIZE = 4096  # Optimizer8bit's min_8bit_size: smaller parameters keep float32 moments
BLOCK_SIZE = 2048  # values per float32 absmax in the blockwise layout
PAGED_MIN_VALUES = 100_000  # get_state_buffer pages a buffer of at least this many values
# On a real GPU the emulation is not bitsandbytes: its PyTorch arithmetic allocates the float32 temporaries that the
# one kernel keeps in registers, and the caching allocator counts them (an H200 measured 12.2 GB where 4.2 GB is
# predicted for torchao's 7B anchor at 2 layers, results/reference/gpu/). The trackers (CPU, fake CUDA) count the
# update as the one kernel it stands for.
REAL_GPU_REFUSAL = ("optimizer:impl=bitsandbytes is an emulation of bitsandbytes' kernel, counted exactly on the CPU "
                    "and predicted on fake CUDA; on a real GPU its arithmetic would allocate temporaries the kernel "
                    "does not, so it is not measured there")


def absmax_blocks(numel: int) -> int:
    """bitsandbytes' count of absmax values (one per block of 2048, the last one ragged)."""
    return -(-numel // BLOCK_SIZE)


def state_bytes(numel: int) -> int:
    """The bytes of one parameter's two moments as bitsandbytes lays them out (without the instance's maps)."""
    if numel < MIN_8BIT_SIZE:
        return 2 * 4 * numel
    return 2 * (numel + 4 * absmax_blocks(numel))


def adamw8bit_class(paged: bool = False) -> type[torch.optim.Optimizer]:
    """bitsandbytes' AdamW8bit (`paged`: PagedAdamW8bit), as the class described above."""

    class BitsandbytesAdamW8bit(torch.optim.Optimizer):
        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
            super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
            self.qmaps: dict[str, torch.Tensor] = {}  # bitsandbytes' name2qmap: one pair per optimizer instance

        def _buffer(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            """get_state_buffer: zeros in the caching allocator, or paged (unified memory) when large enough."""
            if paged and p.numel() >= PAGED_MIN_VALUES:
                if not is_fake(p):
                    raise Unsupported("optimizer:impl=bitsandbytes:paged=true is predicted on fake CUDA only: here its "
                                      "state would be made in the caching allocator, not with cudaMallocManaged")
                with allocating(UNIFIED_MEMORY):
                    return torch.zeros_like(p, dtype=dtype)
            return torch.zeros_like(p, dtype=dtype)

        def _init_state(self, p: torch.Tensor) -> dict:
            if p.is_cuda and not is_fake(p):  # the first step of a real GPU's run goes no further
                raise Unsupported(REAL_GPU_REFUSAL)
            state = self.state[p]
            state["step"] = 0
            if p.numel() < MIN_8BIT_SIZE:
                state["state1"], state["state2"] = self._buffer(p, torch.float32), self._buffer(p, torch.float32)
                return state
            if not self.qmaps:
                create_dynamic_map = import_torchao("torchao.optim.quant_utils").create_dynamic_map
                self.qmaps = {key: torch.tensor(create_dynamic_map(signed=signed), dtype=torch.float32,
                                                device=p.device)
                              for key, signed in (("dynamic", True), ("udynamic", False))}
            state["state1"], state["qmap1"] = self._buffer(p, torch.uint8), self.qmaps["dynamic"]
            state["state2"], state["qmap2"] = self._buffer(p, torch.uint8), self.qmaps["udynamic"]
            blocks = absmax_blocks(p.numel())
            state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
            state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
            return state

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p] if self.state[p] else self._init_state(p)
                    state["step"] += 1
                    with one_fused_kernel():
                        _update(p, p.grad, state, group)
            return loss

    BitsandbytesAdamW8bit.__name__ = BitsandbytesAdamW8bit.__qualname__ = (
        "PagedAdamW8bit" if paged else "AdamW8bit")
    return BitsandbytesAdamW8bit


def _update(p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
    """One parameter's AdamW step, updating the weight and the moments in place (bitsandbytes' kernel's arithmetic;
    run inside one_fused_kernel, whose intermediates no tracker counts)."""
    beta1, beta2 = group["betas"]
    lr, eps, weight_decay, step = group["lr"], group["eps"], group["weight_decay"], state["step"]
    g = grad.float()
    eight_bit = state["state1"].dtype == torch.uint8
    if eight_bit:
        m = _dequantize(state["state1"], state["qmap1"], state["absmax1"])
        v = _dequantize(state["state2"], state["qmap2"], state["absmax2"])
    else:
        m, v = state["state1"], state["state2"]
    m = m * beta1 + (1 - beta1) * g
    v = v * beta2 + (1 - beta2) * g * g
    correction1 = 1 - beta1 ** step
    correction2 = math.sqrt(1 - beta2 ** step)
    weight = p.float()
    if weight_decay > 0:
        weight = weight * (1 - lr * weight_decay)
    weight = weight - (lr * correction2 / correction1) * (m / (v.sqrt() + eps * correction2))
    p.copy_(weight)
    if eight_bit:
        _quantize_into(m, state["state1"], state["qmap1"], state["absmax1"])
        _quantize_into(v, state["state2"], state["qmap2"], state["absmax2"])
    else:
        state["state1"].copy_(m)
        state["state2"].copy_(v)


def _blocks(values: torch.Tensor) -> torch.Tensor:
    """The values flattened into rows of BLOCK_SIZE, the last one padded with zeros."""
    flat = values.reshape(-1)
    return F.pad(flat, (0, absmax_blocks(flat.numel()) * BLOCK_SIZE - flat.numel())).view(-1, BLOCK_SIZE)


def _dequantize(codes: torch.Tensor, qmap: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    values = _blocks(qmap[codes.long()]) * absmax.view(-1, 1)
    return values.reshape(-1)[:codes.numel()].view(codes.shape)


def _quantize_into(values: torch.Tensor, codes: torch.Tensor, qmap: torch.Tensor, absmax: torch.Tensor) -> None:
    quantize = import_torchao("torchao.optim.quant_utils").quantize_8bit_with_qmap
    blocks = _blocks(values)
    scale = blocks.abs().amax(-1)
    absmax.copy_(scale)
    normalised = blocks / scale.clamp(min=1e-12).view(-1, 1)
    codes.copy_(quantize(normalised, qmap).reshape(-1)[:codes.numel()].view(codes.shape))
