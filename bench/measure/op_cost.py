"""What each operator of a training step costs, counted while the step runs (on fake tensors too): FLOPs by
PyTorch's own formulas (`torch.utils.flop_counter`), bytes read and written, bytes moved between devices; and the
CPU's measured speed to turn them into seconds.

`OperatorCostCounter` is a TorchDispatchMode: entered around a step (a strategy's `session()`), it records one
`OpCost` per operator and cuts the records into steps where the step ends. `measure_cpu_speed()` times a matmul,
a convolution and a copy on this CPU in each dtype, in a second or two, so that an estimate on the CPU is
calibrated by what this CPU does, emulated 16-bit arithmetic included.

Limitations: bytes are the sizes of the operator's tensor inputs and outputs (what a kernel that reads each input
once and writes each output once moves); caches, fusion and views are not modelled (a view moves nothing).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from bench.core.quiet_import import quiet_loggers
from bench.measure.dispatch_modes import CompiledCodeMode

with quiet_loggers("torch.utils.flop_counter"):  # a CUDA torch without triton warns; membench runs no triton kernel
    from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten

# operator kinds, by what bounds them: matrix units (matmul, attention), convolutions, or memory
MATMUL, CONV, MEMORY, TRANSFER = "matmul", "conv", "memory", "transfer"
_CONV_PACKETS = {aten.convolution, aten._convolution, aten.convolution_backward, aten.cudnn_convolution,
                 aten.convolution_overrideable, aten._slow_conv2d_forward}


def _cpu_flash_attention(query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_attention_backward(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


# the CPU's fused attention, which torch.utils.flop_counter does not list (it lists CUDA's)
_EXTRA_FORMULAS = {}
for _name, _formula in (("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_attention),
                        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_flash_attention_backward)):
    if hasattr(aten, _name):
        _EXTRA_FORMULAS[getattr(aten, _name)] = _formula


@dataclass(frozen=True)
class OpCost:
    """One operator call: its kind (MATMUL, CONV, MEMORY, TRANSFER), the dtype of its arithmetic, its FLOPs and
    the bytes it reads and writes (for TRANSFER, the bytes copied between devices)."""

    kind: str
    dtype: str
    flops: int
    bytes: int


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _local_shards(value: Any) -> Any:
    """`value` with each DTensor replaced by this rank's shard of it: a dispatch mode sees a DTensor's operator at
    the global shape, before DTensor runs it on the local shards (without the mode), and a rank computes and moves
    only its shards (tensor parallelism's projections: 1/T of the FLOPs)."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)  # none made before its import
    if dtensor is None:
        return value
    return tree_map(lambda t: t._local_tensor if isinstance(t, dtensor) else t, value)


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _dtype_name(tensors: list[torch.Tensor]) -> str:
    floating = [t.dtype for t in tensors if t.is_floating_point()]
    return str(floating[0]).removeprefix("torch.") if floating else "float32"


class OperatorCostCounter(CompiledCodeMode):
    """Records the cost of every operator run under it; `end_step()` closes a step (`steps` holds each step's
    list of OpCost). Views, and operators on no tensor, cost nothing."""

    def __init__(self):
        super().__init__()
        self.current: list[OpCost] = []
        self.steps: list[list[OpCost]] = []

    def end_step(self) -> None:
        self.steps.append(self.current)
        self.current = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or func.overloadpacket in (aten.detach, aten.lift_fresh, aten.alias):
            return out
        result = out
        args, kwargs, out = _local_shards((args, kwargs, out))
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        if not outputs:  # metadata (a fake tensor's `.device`), a scalar read: no kernel to speak of
            return result
        packet = func.overloadpacket
        formula = flop_registry.get(packet) or _EXTRA_FORMULAS.get(packet)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        dtype = _dtype_name(inputs or outputs)
        devices = {t.device.type for t in inputs + outputs}
        if packet in (aten._to_copy, aten.copy_) and len(devices) > 1:
            self.current.append(OpCost(TRANSFER, dtype, 0, _nbytes(outputs)))
            return result
        kind = CONV if packet in _CONV_PACKETS else (MATMUL if flops else MEMORY)
        self.current.append(OpCost(kind, dtype, flops, _nbytes(inputs) + _nbytes(outputs)))
        return result


def step_totals(ops: list[OpCost]) -> dict[str, int]:
    """A step's FLOPs, bytes read and written, bytes moved between devices, and operator count."""
    return {"flops": sum(op.flops for op in ops),
            "bytes": sum(op.bytes for op in ops if op.kind != TRANSFER),
            "transfer_bytes": sum(op.bytes for op in ops if op.kind == TRANSFER),
            "ops": len(ops)}


# --- the CPU's measured speed ------------------------------------------------------------------------------

def _best_seconds(work, repeats: int = 3) -> float:
    work()  # the first call pays for oneDNN's kernel choice and the allocations
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


@dataclass(frozen=True)
class CpuSpeed:
    """This CPU's measured speed: FLOPS per (kind, dtype) for matmuls and convolutions, copy bandwidth, and the
    cost of one small operator (dispatch overhead)."""

    flops: dict[tuple[str, str], float]
    bandwidth_bytes_per_s: float
    op_overhead_s: float


def measure_cpu_speed(dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> CpuSpeed:
    """Times a 512x512 matmul and a 3x3 convolution (32 x 64 channels x 28 x 28) in each dtype, a 32 MiB copy and
    a one-element add, best of three each after one warm-up: about a second, longer where 16-bit is emulated."""
    flops: dict[tuple[str, str], float] = {}
    with torch.no_grad():
        for name in dtypes:
            dtype = getattr(torch, name)
            a, b = torch.randn(512, 512, dtype=dtype), torch.randn(512, 512, dtype=dtype)
            flops[(MATMUL, name)] = 2 * 512**3 / _best_seconds(lambda: torch.mm(a, b))
            x = torch.randn(32, 64, 28, 28, dtype=dtype)
            w = torch.randn(64, 64, 3, 3, dtype=dtype)
            conv_flops = 2 * 32 * 64 * 28 * 28 * 64 * 9
            flops[(CONV, name)] = conv_flops / _best_seconds(lambda: torch.nn.functional.conv2d(x, w, padding=1))
        source = torch.empty(8 * 2**20, dtype=torch.float32)
        target = torch.empty_like(source)
        bandwidth = 2 * source.nbytes / _best_seconds(lambda: target.copy_(source))
        one, other = torch.ones(1), torch.ones(1)

        def small_ops():
            for _ in range(200):
                torch.add(one, other)
        overhead = _best_seconds(small_ops) / 200
    return CpuSpeed(flops, bandwidth, overhead)
