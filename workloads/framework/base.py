"""The workload interface: a model, its data, loss and optimizer, with defaults as class attributes and options.

A workload is a small class (the TorchBench `models/<name>` pattern) that any user can write; see
`examples/my_workload.py`. The training and evaluation steps are not part of it: the runner runs the article's
loop for every workload (forward, float32 loss, backward, optimizer step, zero_grad; eval: one forward), so a
workload only says *what* to train:

- `build_model()`        the model, on the CPU (the runner seeds torch with `seed` first);
- `make_batch(n, data)`  one batch `(inputs, target)`; inputs a tensor, a tuple (positional arguments) or a dict
                         (keyword arguments), the same for the same `n`, `data` and `seed`;
- `loss(output, target)` the training loss, always given the output in float32;
- `make_optimizer(model)`;
- `checkpoint_units(model)` the ordered blocks that activation checkpointing may recompute;
- `has_output_head()`, `output_head(model)`, `hidden_states(model, inputs)` (optional) a language model's
  separable head: the final Linear to the vocabulary and what feeds it, for strategies that compute the head and
  the loss by chunks of tokens (`strategies.chunked_loss`); `loss` then takes a `DeferredHead` for the logits too.

What its model is made of, as far as a strategy's outcome depends on it, is its `traits()` (`Trait`): read from the
model's modules (BatchNorm, ReLU-like activations and whether they run in place, dropout, convolutions), from
`has_output_head()`, and from `declared_traits` for what the modules cannot show. Strategies state their expected
outcome per trait (`strategies.Strategy.expected_with`), so a new workload needs no strategy to name it.

Options work as for strategies: `options = {"layers": 1000}` declares `deep_mlp:layers=100`; the values the
instance runs with are in `self.settings`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from bench.core.errors import UsageError
from bench.core.options import changed_options, check_option_names
from bench.core.registry import Registry
from bench.core.text_enum import TextEnum

WORKLOADS: Registry[type["Workload"]] = Registry("workload")
register_workload = WORKLOADS.register

Batch = Any  # a tensor, a tuple of tensors or a dict of tensors (and a target tensor)


_UNIT_COUNTS: dict[str, int] = {}  # workload spec -> checkpoint units (Workload.checkpoint_unit_count)
_TRAITS: dict[str, frozenset[str]] = {}  # workload spec -> its traits' values (Workload.traits)


def forget_cached(spec: str) -> None:
    """Drops what this process cached for workload `spec` (its checkpoint units, its traits): a workload redefined
    under the same spec (a notebook cell run again) is read afresh."""
    _UNIT_COUNTS.pop(spec, None)
    _TRAITS.pop(spec, None)


class Trait(TextEnum):
    """What a workload's model is made of, where a strategy's outcome depends on it; strategies name a trait by its
    value in `expected_with` (they do not import workloads: the two are one layer)."""

    BATCH_NORM = "batch_norm"  # a BatchNorm layer (normalises by the batch's statistics in training)
    # an activation that can run in place (a module with an `inplace` switch: ReLU, LeakyReLU, ReLU6, SiLU, ELU,
    # Hardswish...; or a module's `inplace_relu` flag, read where its forward calls the functional form) ...
    RELU_LIKE = "relu_like"  # ... computed out of place, into a new tensor
    RELU_LIKE_IN_PLACE = "relu_like_in_place"  # ... computed in place already, over its input
    DROPOUT = "dropout"  # a dropout module with p > 0 (random masks in training)
    CONVOLUTIONAL = "convolutional"  # a convolution layer (nn.Conv*d or nn.ConvTranspose*d)
    OUTPUT_HEAD = "output_head"  # a separable output head (`Workload.has_output_head`)
    TRANSFORMERS_MODEL = "transformers_model"  # a transformers architecture (its `model_type`), declared


# torch's activation modules with an `inplace` switch (ReLU, LeakyReLU, ReLU6, SiLU, ELU, Hardswish...)
IN_PLACE_ACTIVATIONS = tuple(kind for kind in vars(nn.modules.activation).values() if isinstance(kind, type)
                             and issubclass(kind, nn.Module) and "inplace" in inspect.signature(kind).parameters)


def inspected_traits(model: nn.Module) -> frozenset[Trait]:
    """The traits `model`'s modules show (every trait but the output head and the declared ones)."""
    found = set()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            found.add(Trait.BATCH_NORM)
        elif isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            found.add(Trait.DROPOUT)
        elif isinstance(module, nn.modules.conv._ConvNd):
            found.add(Trait.CONVOLUTIONAL)
        in_place = [module.inplace] if isinstance(module, IN_PLACE_ACTIVATIONS) else []
        if hasattr(module, "inplace_relu"):
            in_place.append(module.inplace_relu)
        found.update(Trait.RELU_LIKE_IN_PLACE if flag else Trait.RELU_LIKE for flag in in_place)
    return frozenset(found)


class Workload:
    """One trainable model and the data it is trained on. Override the methods; keep defaults as attributes."""

    name = ""
    description = ""
    default_batch_size = 32
    seed = 0
    # the data sources `make_batch` accepts; the first is the default (e.g. real images, then synthetic)
    data_sources: tuple[str, ...] = ("synthetic",)
    options: dict[str, Any] = {}  # option name -> default; the default's type is the option's type
    # the option that a bare part after the name sets: `timm:resnet18` means `timm:model=resnet18`
    positional_option: str | None = None
    # True when each checkpoint unit's output is the next unit's input and nothing else uses it (a Sequential's
    # children, a transformer's layers): then checkpointing may recompute several consecutive units as one segment.
    # False (a UNet's blocks, whose outputs also feed skip connections): each unit is checkpointed on its own.
    units_chain = True
    # The registry-wide tests (tests/conformance.py) run it at `small`, (spec, batch size): every strategy's case
    # in a second or two on the CPU; a workload without it fails the suite. `small_for` gives another size where
    # one test needs it ("loop": the literal loop's peak, tests/test_loop_lifetimes.py; "emulated16": the fake
    # 16-bit count; "peak_in_backward": a batch whose train peak falls in backward; "fake_cuda": the fake-CUDA
    # grid, None to leave it out of it); `requires`, the optional package those tests need (skipped without it).
    small: tuple[str, int] | None = None
    small_for: dict[str, tuple[str, int] | None] = {}
    requires: str | None = None
    # traits its model has that its modules do not show (`Trait.TRANSFORMERS_MODEL`); see `traits()`
    declared_traits: frozenset[Trait] = frozenset()

    def __init__(self, **options):
        check_option_names("workload", self.name or type(self).__name__, options, self.options)
        self.settings: dict[str, Any] = {**self.options, **options}
        self.reference = ""  # `file.py:NAME` or `module:NAME` for a workload loaded from the user's code
        self.configure()

    @classmethod
    def small_case(cls, purpose: str | None = None) -> tuple[str, int] | None:
        """The (spec, batch size) the tests run it at for `purpose` (a key of `small_for`), else `small`."""
        return cls.small_for.get(purpose, cls.small) if purpose else cls.small

    def configure(self) -> None:
        """Checks the settings and derives what depends on them (a UsageError for a bad value); called again
        whenever the settings change."""

    def require_positive(self, *names: str) -> None:
        """A UsageError naming the first of the options `names` whose value is below 1."""
        for name in names:
            if self.settings[name] < 1:
                raise UsageError(f"{self.name}:{name}={self.settings[name]} must be at least 1")

    # --- what a workload says --------------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        """The model with weights from `seed`, on the CPU."""
        raise NotImplementedError

    def make_batch(self, batch_size: int, data: str) -> tuple[Batch, torch.Tensor]:
        """One `(inputs, target)` batch on the CPU, the same for the same `batch_size`, `data` and `seed`."""
        raise NotImplementedError

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The training loss; `output` is the model's output converted to float32."""
        raise NotImplementedError

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer over `model`'s parameters (default: Adam with PyTorch's defaults, as the article)."""
        return torch.optim.Adam(model.parameters())

    def checkpoint_units(self, model: nn.Module) -> list[nn.Module]:
        """The ordered blocks checkpointing may recompute (default: an nn.Sequential's children, else none)."""
        return list(model.children()) if isinstance(model, nn.Sequential) else []

    def checkpoint_unit_count(self) -> int:
        """How many checkpoint units the model has, counted on a model that holds no memory (`model_structure`),
        once per workload spec in this process."""
        spec = self.spec()
        if spec not in _UNIT_COUNTS:
            _UNIT_COUNTS[spec] = len(self.checkpoint_units(self.model_structure()))
        return _UNIT_COUNTS[spec]

    def model_structure(self) -> nn.Module:
        """The model `build_model` builds, holding no memory: built on the meta device, else (a model whose
        construction meta tensors cannot run) under PyTorch's fake tensors. Its modules, shapes and dtypes are the
        real model's, its values none: what a strategy's `check()` or a planner may look at (the real model of an
        8B preset is 32 GB). A model neither can build is built for real (a user's model that reads its values
        while it is built)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        with torch.random.fork_rng(devices=[]):
            try:
                with torch.device("meta"):
                    return self.build_model()
            except Exception:  # noqa: BLE001 - a construction meta tensors cannot run: fake tensors may
                pass
            try:
                with FakeTensorMode(allow_non_fake_inputs=True):
                    return self.build_model()
            except Exception:  # noqa: BLE001 - nor fake tensors: the real model, as the runner builds it
                return self.build_model()

    def traits(self) -> frozenset[str]:
        """What its model is made of (the values of `Trait`): the traits its modules show, read on a model that holds
        no memory (`model_structure`), the output head if it has one, and its `declared_traits`; once per workload
        spec in this process."""
        spec = self.spec()
        if spec not in _TRAITS:
            found = {*inspected_traits(self.model_structure()), *self.declared_traits}
            if self.has_output_head():
                found.add(Trait.OUTPUT_HEAD)
            _TRAITS[spec] = frozenset(trait.value for trait in found)
        return _TRAITS[spec]

    def has_output_head(self) -> bool:
        """Whether the model has a separable output head (`output_head`), known without building it."""
        return False

    def output_head(self, model: nn.Module) -> nn.Linear | None:
        """The output head of `model`: the final Linear to the vocabulary whose output is the model's output, when
        `loss` is the mean cross-entropy of each token's logits against its target (targets of -100 left out, as
        F.cross_entropy's default) and returns `output.loss(target)` for a `DeferredHead`; None: no such head."""
        return None

    def hidden_states(self, model: nn.Module, inputs: Batch) -> torch.Tensor:
        """What `model` feeds its `output_head` on a batch's inputs: its forward without the head."""
        raise NotImplementedError(f"{type(self).__name__} declares no output head")

    def deferred_head(self, hidden: torch.Tensor,
                      loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> "DeferredHead":
        """The output of a model run without its head, which `loss` turns into the loss by `loss_of(hidden,
        target)` (made here: strategies do not import workloads, they are one layer)."""
        return DeferredHead(hidden, loss_of)

    # --- used by the runner ----------------------------------------------------------------------------------
    def run_model(self, model: nn.Module, inputs: Batch) -> Any:
        """Calls `model` on a batch's inputs: a tuple as positional arguments, a dict as keyword arguments (a model
        that takes the dict itself as one argument gets it from `make_batch` returning `(inputs,)`)."""
        if isinstance(inputs, dict):
            try:
                return model(**inputs)
            except TypeError as error:
                if not any(f"keyword argument '{key}'" in str(error) for key in inputs):
                    raise
                raise TypeError(
                    f"{error}: membench passes a dict of inputs as keyword arguments, "
                    f"model(**{{{', '.join(map(repr, inputs))}}}); for a model whose forward takes the dict whole, "
                    f"make {type(self).__name__}.make_batch return the inputs as a one-element tuple, `(inputs,)`, "
                    f"and it is passed as one positional argument") from None
        if isinstance(inputs, (tuple, list)):
            return model(*inputs)
        return model(inputs)

    def check_data(self, data: str) -> str:
        """`data` if this workload can make it; a UsageError listing its data sources otherwise."""
        if data not in self.data_sources:
            raise UsageError(f"unknown data source {data!r} for workload {self.spec()!r}; valid choices: "
                             f"{', '.join(self.data_sources)}")
        return data

    def prediction_note(self) -> str | None:
        """What a prediction of this workload's step cannot see (a kernel the model's source would run that the
        trace does not), for the predict row's message; None when nothing."""
        return None

    def definition_source(self) -> str | None:
        """Where the model's definition was read when it is data, not this class's code (a config file, with the
        Hub revision it belongs to), for a predict row's `workload_source`; None when nothing was read."""
        return None

    def describe(self) -> dict[str, Any]:
        """The settings this workload runs with, for the row's `workload_settings`."""
        return dict(self.settings)

    def spec(self) -> str:
        """The canonical spelling: `name`, `name:opt=value` for options that differ, or the user's reference."""
        changed = changed_options(self.settings, self.options)
        if self.positional_option:  # `timm:resnet18`, not `timm:model=resnet18`
            changed = [str(self.settings[self.positional_option])] + [
                part for part in changed if not part.startswith(f"{self.positional_option}=")]
        return ":".join([self.reference or self.name, *changed])

    def full_spec(self) -> str:
        """Every option spelled out, defaults included (`hf:gpt2:layers=0:seq_len=128:attn=sdpa:task=auto`): what
        the progress lines print, so that an option the user gave at its default value still shows."""
        parts = [f"{key}={value}" for key, value in self.settings.items() if key != self.positional_option]
        if self.positional_option:
            parts.insert(0, str(self.settings[self.positional_option]))
        return ":".join([self.reference or self.name, *parts])

    def __repr__(self) -> str:
        return f"<workload {self.spec()}>"


class DeferredHead:
    """What a model whose output head is deferred returns in place of its logits (`strategies.chunked_loss`): the
    hidden states that feed the head, and how the token cross-entropy is computed from them and the target."""

    def __init__(self, hidden: torch.Tensor, loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.hidden = hidden
        self.loss_of = loss_of

    def loss(self, target: torch.Tensor) -> torch.Tensor:
        return self.loss_of(self.hidden, target)


def to_device(batch: Any, device: str | torch.device) -> Any:
    """Every tensor of a (nested) batch moved to `device`."""
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)


def to_float32(output: Any) -> Any:
    """Every floating-point tensor of a (nested) output in float32 (the loss always runs in float32)."""
    return tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, output)


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors in a (nested) batch or output, in order."""
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
