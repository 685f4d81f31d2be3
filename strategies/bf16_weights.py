"""Pure bfloat16 training: weights, gradients and optimizer state all in bfloat16, half of float32's bytes each.

Where `amp` keeps float32 weights and runs only the forward's matrix work in 16 bits, this strategy converts the
model itself (`model.to(torch.bfloat16)`) before the optimizer is made: every parameter is bfloat16, so is every
gradient, and the optimizer's state (`zeros_like` of the parameters) too; floating-point inputs are cast to bfloat16
as they enter the model. The loss still runs in float32, on the output converted back (the session's loss, as for
every strategy), and integer inputs (token ids) pass unchanged.

Example: `python -m bench compare --workload hf:gpt2:layers=1:seq_len=64 --strategies bf16_weights,amp --device cpu
--batch-size 2 --quick --phases train`.

Verification: bfloat16 keeps 8 bits of mantissa, so the loss, the gradients and the step differ from float32's by
design; the row's message gives the measured differences (`loss_rel_diff` about 1e-3 on a small language model).

Limitations: nothing guards the update against bfloat16's rounding (no float32 master weights, no stochastic
rounding, no Kahan summation): an update smaller than a weight's last bit (2**-8 of it) is lost, which is why
mixed precision keeps float32 weights. BatchNorm statistics become bfloat16 too. On a CPU without bfloat16
instructions each step runs several times slower than float32 (`python -m bench env` says which kind of CPU).
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_map

from strategies import Strategy, differs, register_strategy

DTYPE = torch.bfloat16


def _cast_floats(value):
    """Every floating-point tensor of a (nested) value in bfloat16; others (token ids, masks) unchanged."""
    return tree_map(lambda t: t.to(DTYPE) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, value)


def _cast_inputs(module: nn.Module, args: tuple, kwargs: dict):
    return _cast_floats(args), _cast_floats(kwargs)


def _convert_fake(model: nn.Module) -> None:
    """Every floating-point parameter and buffer of `model` replaced by a bfloat16 one (a parameter shared by two
    modules, tied weights, stays shared)."""
    converted: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table, make in ((module._parameters, lambda t: nn.Parameter(t.detach().to(DTYPE), t.requires_grad)),
                            (module._buffers, lambda t: t.to(DTYPE))):
            for name, tensor in list(table.items()):
                if tensor is not None and tensor.is_floating_point():
                    if id(tensor) not in converted:
                        converted[id(tensor)] = make(tensor)
                    table[name] = converted[id(tensor)]


@register_strategy
class Bf16Weights(Strategy):
    """The whole model in bfloat16: weights, gradients and optimizer state."""

    name = "bf16_weights"
    description = "pure bfloat16 training: weights, gradients and optimizer state in bfloat16 (no float32 copy)"
    # float32's tolerance (EXACT): the row's message lists each check bfloat16 rounding fails, with its measure
    priority = 22  # after lora (15) put its adapters in, so they are converted too; before checkpoint (30) wraps
    # its memory is pinned on hf:gpt2 in tests/test_llm_strategies.py
    expected = differs("are bfloat16 (8-bit mantissa)")

    def prepare_model(self, model: nn.Module, units: list[nn.Module]) -> nn.Module:
        if any(is_fake(p) for p in model.parameters()):
            _convert_fake(model)  # Module.to cannot swap a fake parameter (predict's fake engines)
        else:
            model.to(DTYPE)  # each Parameter converted in place: hooks on it stay
        # a hook, not a wrapping module: the workload still finds its model's head and layers where they were
        model.register_forward_pre_hook(_cast_inputs, with_kwargs=True)
        return model

    def differs_by_design(self) -> str | None:
        return ("weights, gradients and optimizer state are bfloat16 (8-bit mantissa), so the forward, the gradients "
                "and the update are rounded where the baseline's are float32")
