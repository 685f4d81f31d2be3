"""float8 training of the linear layers: torchao's `convert_to_float8_training`, as torchtitan's `float8` converter
applies it (`model.converters = ["float8"]`).

Each selected `nn.Linear` becomes torchao's `Float8Linear`: its weights stay in their dtype (the optimizer, the
gradients and FSDP's shards are unchanged), and each matmul of forward and backward casts its two operands to float8
(1 byte a value, plus their scales) and runs `torch._scaled_mm`. The forward saves its high-precision input for
backward, as a Linear does (torchao 0.18 casts input and weight again in backward), so what a step holds differs
from the baseline's by the float8 copies alive around each matmul, and, composed with FSDP2, by what is all-gathered.
Options, mirroring torchtitan's `[quantize.linear.float8]` keys:
- `recipe`: `tensorwise` (default: one scale a tensor, e4m3 forward and e5m2 gradients), `rowwise` (a scale a row,
  e4m3 throughout) or `rowwise_with_gw_hp` (rowwise, the weight's gradient in high precision): torchao's
  `Float8LinearConfig.from_recipe_name`;
- `fsdp_float8_all_gather` (`enable_fsdp_float8_all_gather`): composed with `fsdp`, FSDP2 all-gathers each weight
  already cast to float8 (1 byte a value instead of the weight's dtype); tensorwise only, as torchtitan asserts;
- `head`: convert the output head too. torchtitan's Llama jobs list the head (`output`) in `filter_fqns`; here the
  head is the workload's output head, or where it names none its last Linear (a classifier). As torchtitan's
  `module_filter_fn`, a Linear with a dimension not divisible by 16 (the float8 tensor cores' need) is left as it is.

Example: `python -m bench predict --workload hf:llama-3.1-8b:seq_len=2048 --strategies float8+checkpoint --gpu "H100
80GB" --batch-size 2`, or composed with FSDP2 on 8 ranks: `fsdp:param_dtype=bfloat16+float8:fsdp_float8_all_gather=
true --ranks 8`.

Limitations: float8 matmuls need a GPU of compute capability 8.9 or later (Ada, Hopper, Blackwell): on an older one
(the one predicted, `--capability`/`--gpu`, or the one run on) the row is `unsupported`. On the CPU it runs on
torch's CPU `_scaled_mm` (a reference kernel, slow). `rowwise` with float32 outputs runs only on compute capability
9.0 in CUDA (cuBLAS's rowwise kernel); on others `_scaled_mm` wants 16-bit inputs (`fsdp:param_dtype=bfloat16`, or
`bf16_weights`), which a prediction on fake tensors does not check. torchtitan's `precompute_float8_dynamic_scale_
for_fsdp` (one scale computation for every weight after the step) is not applied: each weight's scale is computed
when it is cast, small tensors either way. torchao's float8 with tensor parallelism (its own TP plans)
is not composed here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bench.core.errors import Unsupported, UsageError, choices_error
from bench.core.quiet_import import import_torchao
from strategies import Strategy, differs, register_strategy, unsupported

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# torch._scaled_mm's float8 kernels: Ada (8.9) and later
MIN_CAPABILITY = (8, 9)
# every dimension of a converted weight: float8 tensor cores' multiple (torchtitan's module_filter_fn)
DIM_MULTIPLE = 16


def float8_module():
    """torchao.float8, or Unsupported saying why it cannot be imported."""
    try:
        return import_torchao("torchao.float8")
    except ImportError as error:
        raise Unsupported(f"float8 needs torchao's float8 training (pip install torchao): {error}") from None


def predicted_capability(context) -> tuple[int, int] | None:
    """The compute capability of the CUDA device the case is predicted for (`StepContext.capability`) or runs on
    (the device torch sees: a GPU's, or the fake-CUDA environment's stubs'), None where neither is known."""
    if context.capability is not None:
        return tuple(context.capability)
    if torch.cuda.is_available():
        return tuple(torch.cuda.get_device_capability(0))
    return None


def converted_linears(model: nn.Module, head: nn.Module | None) -> list[str]:
    """The names of the Linear layers of `model` float8 converts: all but `head`, each of whose weight's dimensions
    is a multiple of 16."""
    return [name for name, module in model.named_modules()
            if type(module) is nn.Linear and module is not head
            and all(size % DIM_MULTIPLE == 0 for size in module.weight.shape)]


@register_strategy
class Float8(Strategy):
    """The linear layers' matmuls in float8 (torchao's Float8Linear), weights kept in their dtype."""

    name = "float8"
    description = "float8 training of the linear layers (torchao's Float8Linear): float8 matmuls, weights unchanged"
    options = {"recipe": "tensorwise", "fsdp_float8_all_gather": False, "head": False}
    # after bf16_weights (22), which converts the weights Float8Linear keeps; before checkpoint (30), which wraps the
    # layers, and fsdp (70), which shards the Float8Linear's weights (as torchtitan converts before parallelizing)
    priority = 24
    conflicts = ("lora", "qlora", "tp")
    # the convolutional workloads and the MLP of 8 features have no Linear to convert but their classifier
    expected = unsupported("has no linear layer to convert")
    expected_with = {"output_head": differs("matmuls run in float8")}
    refusals = (r"float8 has no linear layer to convert in (train|eval)",
                r"float8 needs compute capability 8\.9 or later")
    plan_excluded = "it changes the arithmetic (float8 matmuls): a choice of the job, not a memory saving to try"

    def __init__(self, **options):
        super().__init__(**options)
        if self.settings["recipe"] not in RECIPES:
            raise choices_error("float8 recipe", self.settings["recipe"], list(RECIPES))
        if self.settings["fsdp_float8_all_gather"] and self.settings["recipe"] != "tensorwise":
            raise UsageError(f"float8:fsdp_float8_all_gather=true with recipe={self.settings['recipe']}: torchao's "
                             "recipes set it themselves (torchtitan refuses both); valid: recipe=tensorwise")
        self.converted: list[str] = []
        if self.settings["recipe"] != "tensorwise":  # an instance's: what predict's row says of this recipe
            self.prediction_note = ("rowwise float8 with float32 matmul outputs runs on compute capability 9.x only "
                                    "(cuBLAS's kernel); elsewhere torch._scaled_mm needs 16-bit inputs (bf16_weights, "
                                    "fsdp:param_dtype=bfloat16), which this prediction does not check")

    def check(self, context) -> None:
        super().check(context)
        capability = predicted_capability(context) if context.device == "cuda" else None
        if capability is not None and capability < MIN_CAPABILITY:
            raise Unsupported(f"float8 needs compute capability 8.9 or later (Ada, Hopper, Blackwell) for "
                              f"torch._scaled_mm's float8 kernels; the GPU's is {capability[0]}.{capability[1]}")
        float8_module()
        if context.workload is not None:
            self._check_converts_some(context.workload.model_structure())

    def _check_converts_some(self, model: nn.Module) -> list[str]:
        """The layers it converts in `model`; Unsupported where there are none."""
        converted = converted_linears(model, self.head(model))
        if not converted:
            raise Unsupported(f"float8 has no linear layer to convert in {self.context.phase}: {self.model_owner()} "
                              f"has no Linear {'' if self.settings['head'] else 'but its output layer '}whose "
                              f"dimensions are multiples of {DIM_MULTIPLE}")
        return converted

    def config(self):
        """torchao's Float8LinearConfig of these options."""
        config_class = float8_module().Float8LinearConfig
        if self.settings["recipe"] != "tensorwise":
            return config_class.from_recipe_name(self.settings["recipe"])
        return config_class(enable_fsdp_float8_all_gather=self.settings["fsdp_float8_all_gather"])

    def head(self, model: nn.Module) -> nn.Module | None:
        """The layer left out unless `head=true`: the workload's output head, else the model's last Linear."""
        if self.settings["head"]:
            return None
        workload = self.context.workload
        head = workload.output_head(model) if workload is not None else None
        if head is None:
            head = next((m for m in reversed(list(model.modules())) if isinstance(m, nn.Linear)), None)
        return head

    def prepare_model(self, model: nn.Module, units: list[nn.Module]) -> nn.Module:
        self.converted = self._check_converts_some(model)
        chosen = set(self.converted)
        float8_module().convert_to_float8_training(model, config=self.config(),
                                                   module_filter_fn=lambda module, name: name in chosen)
        return model

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "float8.converted_layers": len(self.converted)}

    def differs_by_design(self) -> str | None:
        return (f"the matmuls run in float8 ({self.settings['recipe']} scales) in {len(self.converted)} linear "
                "layers, so the forward, the gradients and the update are rounded where the baseline's are not")
