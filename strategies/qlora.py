"""QLoRA: LoRA adapters (peft) over base weights stored in 4-bit NormalFloat (torchao's NF4Tensor, as torchtune does).

QLoRA (Dettmers et al., 2023) trains LoRA adapters beside frozen base weights kept in 4 bits: each weight is cut
into blocks of `block` (64) values, each value stored as the index (4 bits, two per byte) of the nearest of the 16
NormalFloat levels, and each block's absolute maximum (its scale) is itself quantised ("double quantisation") to an
int8 per block, with one float scale per `scaler_block` (256) block scales and one mean per weight. This strategy
puts peft's LoRA layers on the target modules (as `lora` does; `targets=all-linear` by default, the paper's
choice: every linear layer but the output head), then replaces each adapted layer's base weight, and every other
linear layer of the workload's layers, by `torchao.quantization.to_nf4(weight, block, scaler_block)` in a frozen
module that computes with it as torchtune's `FrozenNF4Linear` and `LoRALinear(quantize_base=True)` do: torchao's
`linear_nf4`, an autograd function that dequantises the weight to the input's dtype for the product, in forward and
again in backward, and saves only the 4-bit weight (transformers' Conv1D, which stores its weight as (in, out), gets
the same function on `x @ W`).

Storage of a quantised weight of N values in dtype d (s bytes), all of it counted by the live-tensor tracker (the
NF4Tensor is a wrapper subclass: the tracker counts the tensors inside it): N/2 bytes of codes (uint8), N/block int8
block scales, N/(block*scaler_block) scales of the block scales in d, one mean in d, and the 16-level table in d
(each weight holds its own). A weight of one scaler block only (N = block*scaler_block) keeps the 256 entries
torchao computed its one scale from (a view of them, made contiguous, is that storage): 256*s bytes, not s.
`nf4_weight_bytes()` gives this count; tests compare it with the tracker's.

Options: those of `lora` (`r`, `alpha`, `dropout`, `targets`: module names separated by `/`, `auto`, or
`all-linear`), and `block` (64), `scaler_block` (256): torchao's `block_size` and `scaler_block_size`. A weight
whose number of values is not a multiple of `block * scaler_block` cannot be quantised by torchao: the row is
`unsupported` and names it (use smaller blocks on a tiny model: `qlora:scaler_block=8`).

Example: `python -m bench compare --workload hf:llama-3.2-1b:layers=2:seq_len=128 --strategies
lora,qlora,qlora+checkpoint --device cpu --batch-size 2 --quick --phases train`.

Verification: the base weights are rounded to 4 bits, so the first loss already differs from the baseline's, and
only the adapters train: the row differs by design; its message gives the measured loss and weight differences.

Limitations: train phase only. The base weights are quantised from the workload's float32 weights (torchtune
quantises bfloat16 ones: `qlora+bf16_weights` does that, quantising after the conversion); the computation runs in
the input's dtype. Quantised: the base layer of every adapted module, and every other linear layer of the
workload's layers (its checkpoint units: the decoder or encoder blocks), as torchtune's QLoRA models (a projection
without an adapter is a `FrozenNF4Linear`) and bitsandbytes' 4-bit loading do; embeddings, norms and the output head
keep their dtype.
On fake tensors (predict) torchao's quantisation runs on the fake weights, once per layout (`_to_nf4`): the same
shapes, hence the same bytes.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from bench.core.errors import Unsupported, UsageError
from bench.core.quiet_import import import_torchao
from strategies import differs, register_strategy, unsupported
from strategies.lora import ALL_LINEAR, INSTALL_HINT, Lora

NF4_LEVELS = 16  # the NormalFloat table every NF4Tensor holds, in its weight's dtype


def nf4_module():
    """torchao's module holding `to_nf4` and `linear_nf4`; Unsupported naming the extra without torchao."""
    try:
        module = import_torchao("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    except ImportError:
        try:  # torchao before 0.15 kept it in torchao.dtypes
            module = import_torchao("torchao.dtypes.nf4tensor")
        except ImportError:
            raise Unsupported(f"qlora needs torchao's NF4Tensor, not installed: {INSTALL_HINT}") from None
    return module


@contextlib.contextmanager
def _in_one_chunk_on_fake_tensors(nf4, weight: torch.Tensor):
    """torchao quantises a weight in chunks of its CHUNK_SIZE values (1Mi), to bound the memory of its temporaries;
    on fake or meta tensors (predict), which hold no memory, the weight is quantised in one chunk: the same tensors
    (only temporaries differ, and the model is built before the tracker starts), in a few operators instead of five
    per chunk, each a fake dispatch (most of a full-size QLoRA prediction's time: 16 to 56 chunks per weight, seven
    weights per Llama-3.1-8B layer)."""
    from torch._subclasses.fake_tensor import is_fake

    chunk = getattr(nf4, "CHUNK_SIZE", None)
    if chunk is None or not (weight.is_meta or is_fake(weight)):
        yield
        return
    nf4.CHUNK_SIZE = max(chunk, weight.numel())
    try:
        yield
    finally:
        nf4.CHUNK_SIZE = chunk


# the NF4Tensor layout torchao made for a fake or meta weight, by what it depends on: (the weight's shape, strides,
# storage offset, dtype, device type, block, scaler block) -> (its block size, block count and scaler block size, and
# per inner tensor (shape, strides, storage offset, storage elements, dtype)); no values: a fake weight has none
_NF4_LAYOUTS: dict[tuple, tuple] = {}
_NF4_INNER = ("quantized_scalers", "quantization_factor", "scaler_mean", "quantized_data", "nf4")


def _to_nf4(nf4, weight: torch.Tensor, block: int, scaler_block: int):
    """`to_nf4(weight, block, scaler_block)`; on fake or meta tensors (predict), where a weight holds no values,
    torchao quantises each layout once (in one chunk: `_in_one_chunk_on_fake_tensors`) and a weight of a layout met
    before gets new empty tensors of the same shapes, strides and storages (one NF4Tensor of the same bytes; a
    Llama-3.1-8B layer has seven weights of four layouts, quantised again in every small trace of layer replay)."""
    from torch._subclasses.fake_tensor import is_fake

    if not (weight.is_meta or is_fake(weight)):
        return nf4.to_nf4(weight, block, scaler_block)
    key = (tuple(weight.shape), weight.stride(), weight.storage_offset(), weight.dtype, weight.device.type, block,
           scaler_block)
    layout = _NF4_LAYOUTS.get(key)
    if layout is None:
        with _in_one_chunk_on_fake_tensors(nf4, weight):
            quantized = nf4.to_nf4(weight, block, scaler_block)
        _NF4_LAYOUTS[key] = (quantized.block_size, quantized.n_blocks, quantized.scaler_block_size, tuple(
            (tuple(inner.shape), inner.stride(), inner.storage_offset(),
             inner.untyped_storage().nbytes() // inner.element_size(), inner.dtype)
            for inner in (getattr(quantized, name) for name in _NF4_INNER)))
        return quantized
    block_size, n_blocks, scaler_block_size, inners = layout
    tensors = [weight.new_empty(elements, dtype=dtype).as_strided(shape, stride, offset)
               for shape, stride, offset, elements, dtype in inners]
    meta = nf4.SubclassTensorArgs(weight.size(), weight.stride(), weight.storage_offset(), weight.dtype,
                                  weight.device, weight.requires_grad)
    return nf4.NF4Tensor(meta, block_size, n_blocks, scaler_block_size, *tensors)


def nf4_weight_bytes(numel: int, element_size: int, block: int = 64, scaler_block: int = 256) -> int:
    """The bytes torchao's NF4Tensor of a weight of `numel` values in a dtype of `element_size` bytes holds."""
    blocks = numel // block
    scaler_blocks = blocks // scaler_block
    factors = scaler_block if scaler_blocks == 1 else scaler_blocks  # see the module's docstring
    return numel // 2 + blocks + (factors + 1 + NF4_LEVELS) * element_size


def _dequantisation_layout(weight) -> tuple[tuple, tuple]:
    """(the layout of an NF4Tensor's dequantisation, the tensors it reads): its shape, dtype and blocks, and each
    inner tensor's shape, strides, offset, dtype and storage bytes; what `get_original_weight` allocates follows."""
    names, context = weight.__tensor_flatten__()
    inner = tuple(getattr(weight, name) for name in names)
    layout = tuple((tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.untyped_storage().nbytes())
                   for t in inner)
    return (tuple(weight.shape), weight.dtype, context["block_size"], context["n_blocks"],
            context["scaler_block_size"], layout), inner


class _MatmulNF4(torch.autograd.Function):
    """`x @ W` for an NF4 weight stored as (in, out) (transformers' Conv1D): saves the 4-bit weight only and
    dequantises it again in backward, as torchao's `linear_nf4` does for (out, in)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return x @ weight.get_original_weight().to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return grad_output @ weight.get_original_weight().to(grad_output.dtype).t(), None


class FrozenNF4Linear(nn.Module):
    """A frozen linear layer whose weight is an NF4Tensor (torchtune's FrozenNF4Linear); `transposed` for a weight
    stored as (in, out) like transformers' Conv1D. The weight keeps its parameter name (`weight`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.transposed = transposed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.transposed:
            out = _MatmulNF4.apply(x, self.weight)
        else:
            out = nf4_module().linear_nf4(x, self.weight)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, nf4, transposed={self.transposed}"


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"  # transformers' (in, out) layer


def _quantised_layers(model: nn.Module, units: list[nn.Module]) -> dict[str, tuple[nn.Module, str, nn.Module]]:
    """name -> (parent, attribute, layer) of each linear layer whose weight becomes NF4: the base layer of every
    module peft adapted, and every other linear layer of the workload's layers (decoder or encoder blocks: its
    checkpoint units), as torchtune's QLoRA models (`FrozenNF4Linear` where a projection has no adapter) and
    bitsandbytes' 4-bit loading do; never the adapters, the embeddings, nor the output head outside the layers."""
    from peft.tuners.lora import LoraLayer

    in_units = {id(m) for unit in units for m in unit.modules()}
    adapters = [m for m in model.modules() if isinstance(m, LoraLayer)]
    in_adapters = {id(m) for layer in adapters for m in layer.modules()}  # LoRA layers, their A and B, base layers
    found: dict[str, tuple[nn.Module, str, nn.Module]] = {}
    for parent_name, parent in model.named_modules():
        for attribute, child in parent.named_children():
            if isinstance(parent, LoraLayer) and attribute == "base_layer":
                found[parent_name] = (parent, attribute, child)
            elif _is_linear(child) and id(child) in in_units and id(child) not in in_adapters:
                found[f"{parent_name}.{attribute}" if parent_name else attribute] = (parent, attribute, child)
    return found


@register_strategy
class Qlora(Lora):
    """LoRA adapters over 4-bit NF4 base weights (torchao), the QLoRA recipe torchtune follows."""

    name = "qlora"
    description = ("QLoRA: LoRA adapters (peft) over frozen base weights in 4-bit NF4 (torchao's NF4Tensor, "
                   "double-quantised block scales)")
    options = {**Lora.options, "targets": ALL_LINEAR, "block": 64, "scaler_block": 256}
    # after bf16_weights (22), so that it quantises the converted weights as torchtune does; before checkpoint and
    # optimizer (30), which wrap the layers and replace the optimizer this one rebuilds
    priority = 25
    conflicts = ("lora",)
    # targets=all-linear: peft leaves a transformers head out, so a model that is no hf: architecture has nothing to
    # adapt (tests/test_qlora.py runs it on hf:tiny-llama and hf:tiny-gpt2, bytes pinned)
    expected = unsupported("is not an hf: architecture")
    expected_with = {"transformers_model": differs("are stored in 4-bit NF4")}
    refusals = (r"targets=all-linear has nothing to adapt in (train|eval): .* is not an hf: architecture",)
    # torchao's NF4 needs 256 blocks of 64 per weight scale: hf:tiny-llama's weights have 8 to 32
    test_spec = "qlora:scaler_block=8"

    def __init__(self, **options):
        super().__init__(**options)
        for option in ("block", "scaler_block"):
            if self.settings[option] < 1 or (option == "block" and self.settings[option] % 2):
                raise UsageError(f"qlora:{option}={self.settings[option]} must be a positive"
                                 f"{' even' if option == 'block' else ''} number of values")
        self.quantized = 0  # weights replaced by NF4 ones, once the model is prepared
        self.quantized_params = 0  # their values

    def check(self, context) -> None:
        super().check(context)
        nf4_module()

    def replayable_calls(self):
        """torchao's dequantisation of a weight, whose memory follows from the weight's layout
        (`_dequantisation_layout`): twenty operators a weight, in every forward, recompute and backward."""
        return [(nf4_module().NF4Tensor, "get_original_weight", _dequantisation_layout)]

    def prepare_model(self, model: nn.Module, units: list[nn.Module]) -> nn.Module:
        model = super().prepare_model(model, units)
        nf4 = nf4_module()
        block, scaler_block = self.settings["block"], self.settings["scaler_block"]
        layers = _quantised_layers(model, units)
        self.quantized = self.quantized_params = 0  # each pass prepares a fresh model with this instance
        for name, (_, _, linear) in layers.items():  # every check before any change
            if linear.weight.numel() % (block * scaler_block):
                raise Unsupported(f"qlora cannot quantise {name} of {self.model_owner()}: its "
                                  f"{linear.weight.numel():,} values are not a multiple of block*scaler_block = "
                                  f"{block}*{scaler_block} (torchao's NF4 layout); try smaller blocks "
                                  "(qlora:scaler_block=...)")
        for parent, attribute, linear in layers.values():
            weight = linear.weight.detach().contiguous()
            with torch.no_grad():
                quantized = _to_nf4(nf4, weight, block, scaler_block)
            setattr(parent, attribute, FrozenNF4Linear(quantized, linear.bias, type(linear).__name__ == "Conv1D"))
            self.quantized += 1
            self.quantized_params += linear.weight.numel()
        return model

    def describe(self) -> dict[str, Any]:
        return {**{key.replace("lora.", "qlora.", 1): value for key, value in super().describe().items()},
                "qlora.block": self.settings["block"], "qlora.scaler_block": self.settings["scaler_block"],
                "qlora.nf4_weights": self.quantized}

    def differs_by_design(self) -> str | None:
        share = f" ({self.trainable:,} of {self.total:,} parameters)" if self.total else ""
        return (f"QLoRA: the base weights of {self.quantized} layers ({self.quantized_params:,} values) are stored in "
                f"4-bit NF4 (blocks of {self.settings['block']}), so the first forward already differs from the "
                f"baseline's, and only rank-{self.settings['r']} adapters on {'/'.join(self.targets)}{share} train; "
                "the base weights are frozen (no gradient, no update)")
