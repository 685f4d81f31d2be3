"""LoRA through peft: low-rank adapters trained beside frozen base weights (no gradients, no optimizer state for them).

LoRA (Hu et al., 2021) adds to each targeted Linear a product `B @ A` of rank `r`, scaled by `alpha / r`, and trains
only `A` and `B`: the base weights get no gradient and no optimizer state, which for AdamW is three of the four
copies of the weights a full fine-tune holds. peft's `inject_adapter_in_model` puts its LoRA layers into the model
in place (no `PeftModel` wrapper, so the workload's checkpoint units, output head and hidden states are where they
were) and freezes every other parameter; the optimizer is then rebuilt over the trainable parameters only, with the
workload's hyperparameters.

Options: `r` (8, the rank), `alpha` (16), `dropout` (0.0), `targets`: the names of the modules to adapt, separated
by `/` (`lora:r=64:targets=q_proj/k_proj/v_proj/o_proj/gate_proj/up_proj/down_proj`: attention and MLP of Llama);
`auto`: the attention projections peft adapts by default for the architecture of an `hf:` workload (`q_proj/v_proj`
for Llama, Mistral and Qwen2, `c_attn` for GPT-2, `query/value` for BERT); or `all-linear`: peft's preset, every
Linear (and transformers' Conv1D) layer but the output head (the QLoRA paper's choice). The row's `lora.targets`
names the modules adapted (the preset resolved).

Example: `python -m bench compare --workload hf:llama-3.2-1b:layers=2:seq_len=256 --strategies lora,lora+checkpoint
--device cpu --batch-size 2 --quick --phases train`.

Verification: `B` starts at zero, so the first forward's loss equals the baseline's exactly (`loss_rel_diff` 0);
the frozen weights then get no gradient (`params_without_grad` counts them) and no update, so the row differs from
the baseline by design, and its message gives the measured difference.

Limitations: train phase only (in eval the adapters add nothing to save). `targets=auto` needs an `hf:` workload of
an architecture peft knows; any other workload is `unsupported` unless `targets=` names its modules (peft adapts
Linear, Conv and Embedding layers). peft is an optional dependency (`membench[hf]`); without it the row is
`unsupported` and says how to install it. A LoRA parameter's gradient counts under `peak_temp_bytes`, not
`peak_grads_bytes`, in the breakdown (the session watches the gradients of the parameters the workload built).
On fake tensors (predict's engines), where `Module.to` cannot move a fake parameter as peft does, the adapters are
made on meta and then as fake zeros beside their base layers: the same shapes and bytes, no values.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from bench.core.errors import Unsupported, UsageError
from strategies import Strategy, differs, register_strategy, unsupported
from strategies.framework import module_names

INSTALL_HINT = "pip install 'membench[hf]' (in a checkout: make install)"
TARGET_SEPARATOR = "/"  # `,` separates the strategies of --strategies, `+` members, `:` options
BASE_LAYER = ".base_layer."  # peft keeps the adapted module inside its LoRA layer under this name
ALL_LINEAR = "all-linear"  # peft's preset (INCLUDE_LINEAR_LAYERS_SHORTHAND): every linear layer but the output head


def import_peft():
    """The peft module; Unsupported naming the extra when it is missing or does not import."""
    try:
        return importlib.import_module("peft")
    except ModuleNotFoundError as error:
        if error.name in (None, "peft"):
            raise Unsupported(f"lora needs the peft package, not installed: {INSTALL_HINT}") from None
        raise Unsupported(f"lora: peft is installed but does not import ({error}): {INSTALL_HINT}") from None
    except (ImportError, RuntimeError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise Unsupported(f"lora: peft does not import here ({first_line})") from None


def default_targets(model_type: str | None) -> list[str] | None:
    """The modules peft adapts by default for a transformers architecture (`model_type`), None if it knows none."""
    if model_type is None:
        return None
    mapping = importlib.import_module("peft.utils.constants").TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    targets = mapping.get(model_type)
    return list(targets) if targets else None


@register_strategy
class Lora(Strategy):
    """Low-rank adapters (peft's LoRA) on the target modules; every other parameter frozen."""

    name = "lora"
    description = ("LoRA adapters (peft) on the attention projections; base weights frozen: no gradients, no "
                   "optimizer state for them")
    phases = ("train",)
    options = {"r": 8, "alpha": 16, "dropout": 0.0, "targets": "auto"}
    # before checkpoint (30) wraps the layers the adapters go into, and before optimizer (30) replaces the optimizer
    # this one rebuilt over the trainable parameters
    priority = 15
    # run and its memory pinned on hf:tiny-gpt2 and hf:tiny-llama in tests/test_llm_strategies.py
    expected = unsupported("is not an hf: architecture")
    expected_with = {"transformers_model": differs("the base weights are frozen")}
    refusals = (r"is not an hf: architecture peft has default targets for",)

    def __init__(self, **options):
        super().__init__(**options)
        s = self.settings
        if s["r"] < 1:
            raise UsageError(f"lora:r={s['r']} must be at least 1")
        if not 0 <= s["dropout"] < 1:
            raise UsageError(f"lora:dropout={s['dropout']} must be in [0, 1)")
        if any(not name for name in str(s["targets"]).split(TARGET_SEPARATOR)):
            raise UsageError(f"lora:targets={s['targets']!r} has an empty module name; expected auto or module "
                             f"names separated by {TARGET_SEPARATOR!r} (q_proj{TARGET_SEPARATOR}v_proj)")
        self.targets: list[str] = []  # resolved by check(), or by prepare_model() when bound unchecked
        self.trainable = 0  # parameters (elements) the adapters add, once the model is prepared
        self.total = 0

    def check(self, context) -> None:
        if self.settings["targets"] == ALL_LINEAR and getattr(context.workload, "model_type", None) is None:
            # peft leaves a transformers model's output head out of the preset; in another model it would adapt it
            raise Unsupported(f"{self.name}:targets={ALL_LINEAR} has nothing to adapt in {context.phase}: "
                              f"{self.model_owner()} is not an hf: architecture, whose output head peft leaves out; "
                              f"name its modules with {self.name}:targets=a{TARGET_SEPARATOR}b")
        # the workload first: a model with nothing to adapt is unsupported in either phase, for that reason
        model_type = getattr(context.workload, "model_type", None)  # an hf: workload's transformers architecture
        auto = self.settings["targets"] == "auto"
        if auto and model_type is None:
            raise Unsupported(f"lora has nothing to adapt by default in {context.phase}: {self.model_owner()} is not "
                              "an hf: architecture peft has default targets for; name its modules with "
                              f"lora:targets=a{TARGET_SEPARATOR}b{self._linear_names()}")
        super().check(context)
        self._resolve_targets()

    def _resolve_targets(self) -> list[str]:
        """The module names to adapt: `targets=`, or peft's default for the bound hf: workload's architecture."""
        import_peft()
        model_type = getattr(self.context.workload, "model_type", None)
        if self.settings["targets"] == ALL_LINEAR:
            self.targets = [ALL_LINEAR]  # peft resolves it against the model (`adapted_modules` names them)
        elif self.settings["targets"] != "auto":
            self.targets = str(self.settings["targets"]).split(TARGET_SEPARATOR)
        elif (targets := default_targets(model_type)) is not None:
            self.targets = targets
        else:
            raise Unsupported(f"lora has nothing to adapt by default in {self.context.phase}: peft has no default "
                              f"targets for {model_type} ({self.model_owner()}); name its modules with "
                              f"lora:targets=a{TARGET_SEPARATOR}b{self._linear_names()}")
        return self.targets

    def _linear_names(self) -> str:
        """`; its Linear modules: a, b, ...` for a message that asks the user to name modules (the names read on a
        model built on meta); empty where there are none to list."""
        names = module_names.linear_module_suffixes(self.context.workload) if self.context.workload else []
        return f" (its Linear modules: {module_names.listed(names)})" if names else ""

    def prepare_model(self, model: nn.Module, units: list[nn.Module]) -> nn.Module:
        peft = import_peft()
        if not self.targets:  # bound but not checked (predict's engines bind a strategy per device)
            self._resolve_targets()
        config = peft.LoraConfig(r=self.settings["r"], lora_alpha=self.settings["alpha"],
                                 lora_dropout=self.settings["dropout"],
                                 target_modules=ALL_LINEAR if self.targets == [ALL_LINEAR] else list(self.targets),
                                 bias="none", fan_in_fan_out=_transposed(model, self.targets))
        fake = any(is_fake(p) for p in model.parameters())
        try:
            # on fake tensors (predict), Module.to cannot swap a fake parameter, which peft does to put each adapter
            # where its base layer is: there the adapters are made on meta (peft then leaves them) and made fake
            with torch.device("meta") if fake else contextlib.nullcontext():
                peft.inject_adapter_in_model(config, model)
        except ValueError as error:  # peft: "Target modules {...} not found in the base model"
            raise Unsupported(f"lora has nothing to adapt in {self.context.phase}: {self.model_owner()}: "
                              f"{str(error).splitlines()[0]}{self._linear_names()}") from None
        if fake:
            _materialize_meta_parameters(model)
        self.targets = adapted_modules(model)
        self.trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.total = sum(p.numel() for p in model.parameters())
        return model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        """The workload's optimizer class and hyperparameters over the trainable parameters only: the frozen base
        weights are not in it at all (no state, nothing to skip)."""
        groups = [{**{key: value for key, value in group.items() if key != "params"},
                   "params": [p for p in group["params"] if p.requires_grad]} for group in optimizer.param_groups]
        return type(optimizer)([group for group in groups if group["params"]])

    def baseline_parameter_name(self, name: str) -> str:
        return name.replace(BASE_LAYER, ".")

    def describe(self) -> dict[str, Any]:
        return {"lora.r": self.settings["r"], "lora.alpha": self.settings["alpha"],
                "lora.dropout": self.settings["dropout"], "lora.targets": TARGET_SEPARATOR.join(self.targets),
                "lora.trainable_params": self.trainable}

    def differs_by_design(self) -> str | None:
        share = f" ({self.trainable:,} of {self.total:,} parameters)" if self.total else ""
        return (f"LoRA trains only rank-{self.settings['r']} adapters on {TARGET_SEPARATOR.join(self.targets)}"
                f"{share}; the base weights are frozen (no gradient, no update); the first loss is the "
                "baseline's (the adapters start at zero)")


def adapted_modules(model: nn.Module) -> list[str]:
    """The names (last component, as `targets=` takes them) of the modules peft put a LoRA layer on, in order."""
    from peft.tuners.lora import LoraLayer

    names = [name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, LoraLayer)]
    return list(dict.fromkeys(names))


def _materialize_meta_parameters(model: nn.Module) -> None:
    """Each parameter on meta replaced by zeros of its shape where the model's other parameters are, with their
    dtype (under the fake mode: fake tensors, whose values no one reads)."""
    placed = next(p for p in model.parameters() if not p.is_meta)
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                module._parameters[name] = nn.Parameter(
                    torch.zeros(param.shape, dtype=placed.dtype, device=placed.device),
                    requires_grad=param.requires_grad)


def _transposed(model: nn.Module, targets: list[str]) -> bool:
    """Whether the target modules store their weight as (in, out): transformers' Conv1D (GPT-2's `c_attn`), for which
    peft needs `fan_in_fan_out` (it would set it itself, with a warning)."""
    for name, module in model.named_modules():
        if (targets == [ALL_LINEAR] or name.split(".")[-1] in targets) and type(module).__name__ == "Conv1D":
            return True
    return False
