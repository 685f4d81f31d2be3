"""The strategy plug-in API: a small class with hook points, composed by name with `+`.

A strategy is applied only to the stage it concerns (the pyperf hook pattern):
- `session()`      process-wide settings for the whole case, restored on exit (cudnn flags);
- `prepare_model()` transform the model once, before the optimizer sees it (in-place ReLU, checkpointing of the
                   workload's checkpoint units); raises Unsupported when the model gives it nothing to do;
- `shard_batch()`, `wrap_optimizer()`  what one process trains on and with (sharded training);
- `forward()`      a context around the forward pass only (autocast, no_grad); the loss runs outside it;
- `backward()`, `optimizer_step()`, `unscale_grads()`  the backward pass and the step (GradScaler);
- `end_step()`     what the training loop keeps or frees between steps;
- `describe()`     the settings it ran with, written into the result row.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields
from typing import Any, ContextManager

import torch
from torch import nn

from bench.errors import UsageError, Unsupported, choices_error
from bench.options import changed_options, check_option_names, parse_option_parts
from bench.registry import Registry

PHASES = ("train", "eval")
DEVICES = ("cpu", "cuda")

STRATEGIES: Registry[type["Strategy"]] = Registry("strategy")
register_strategy = STRATEGIES.register


@dataclass(frozen=True)
class Tolerance:
    """How close to the baseline a strategy's loss and gradients must be to count as the same result."""

    loss_rtol: float = 1e-5
    grad_rtol: float = 1e-4  # per parameter: |grad - ref| / |ref| (norms); also the BatchNorm statistics' rtol
    output_atol: float = 1e-5  # an output (eval) or BatchNorm statistic within this, element by element, matches
    output_rtol: float = 1e-5  # else an output matches when |out - ref| / |ref| (norms) is within this

    def loosest(self, other: "Tolerance") -> "Tolerance":
        return Tolerance(**{f.name: max(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)})


# fp32 strategies reorder no arithmetic, or only reorder float sums: they must match to float tolerance.
EXACT = Tolerance()


@dataclass
class StepContext:
    """What a strategy may need to know about the case it runs in."""

    phase: str
    device: str
    workload: Any = None  # the case's workloads.Workload (its checkpoint units, whether they chain, its spec)
    ranks: int = 1  # processes of torch.distributed the run asks for (--ranks); sharding strategies need 2 or more


class Strategy:
    """Base class: every hook does nothing, so `Strategy()` behaves exactly like the baseline."""

    name = ""
    description = ""
    phases: tuple[str, ...] = PHASES
    devices: tuple[str, ...] = DEVICES
    tolerance: Tolerance = EXACT
    options: dict[str, Any] = {}  # option name -> default; the default's type is the option's type
    priority = 50  # composition order: lower runs its prepare_model first and sits outside in contexts
    conflicts: tuple[str, ...] = ()
    distributed = False  # runs as `ranks` processes of torch.distributed (bench.ranks launches them)

    def __init__(self, **options):
        check_option_names("strategy", self.name, options, self.options)
        self.settings = {**self.options, **options}
        self.context = StepContext(phase="train", device="cpu")

    def bind(self, context: StepContext) -> None:
        """Called once per case, before any other hook."""
        self.context = context

    def check(self, context: StepContext) -> None:
        """Raises Unsupported when this strategy cannot run in `context`."""
        if context.phase not in self.phases:
            raise Unsupported(f"{self.name} applies to phase {'/'.join(self.phases)} only, not {context.phase}")
        if context.device not in self.devices:
            raise Unsupported(f"{self.name} needs device {'/'.join(self.devices)}, not {context.device}")

    def session(self) -> ContextManager:
        """Process-wide settings for the whole case; restored when the context exits."""
        return contextlib.nullcontext()

    def prepare_model(self, model: nn.Module, units: list[nn.Module]) -> nn.Module:
        """Returns the model to train (may be `model` changed in place, or a wrapper sharing its parameters)."""
        return model

    def shard_batch(self, batch: tuple[Any, torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """The part of the step's `(inputs, target)` this process trains on (all of it, unless sharded)."""
        return batch

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer to train with, given the workload's (a sharded optimizer may replace it)."""
        return optimizer

    def forward(self) -> ContextManager:
        """A context around the forward pass only."""
        return contextlib.nullcontext()

    def reduce_loss(self, loss: torch.Tensor) -> float:
        """The loss of the whole step's batch, for the comparison with the baseline (an average across ranks)."""
        return float(loss.detach())

    def backward(self, loss: torch.Tensor) -> None:
        """Computes gradients from `loss`."""
        loss.backward()

    def unscale_grads(self, optimizer: torch.optim.Optimizer) -> None:
        """Brings `.grad` to the true gradient's scale (for comparison with the baseline)."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Applies the gradients."""
        optimizer.step()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Clears the gradients after the step (the article's plain `optimizer.zero_grad()`)."""
        optimizer.zero_grad()

    def end_step(self, kept: dict[str, Any]) -> None:
        """`kept` holds what the article's loop keeps alive until the next step (output, loss); may drop it."""

    def describe(self) -> dict[str, Any]:
        """The settings this strategy ran with, as `name.option -> value` for the result row."""
        return {f"{self.name}.{k}": v for k, v in self.settings.items()}

    def spec(self) -> str:
        """The canonical spelling: `name` or `name:opt=value` for options that differ from the default."""
        return ":".join([self.name, *changed_options(self.settings, self.options)])


def _overrides(strategy: Strategy, hook: str) -> bool:
    return getattr(type(strategy), hook) is not getattr(Strategy, hook)


class Composite(Strategy):
    """Several strategies applied together; built by `parse_strategy("a+b")`, order-independent."""

    def __init__(self, members: list[Strategy]):
        self.members = sorted(members, key=lambda s: (s.priority, s.name))
        names = [m.name for m in self.members]
        if len(set(names)) != len(names):
            raise UsageError(f"strategy {'+'.join(names)!r} names a strategy twice")
        for m in self.members:
            for other in m.conflicts:
                if other in names:
                    raise UsageError(f"strategies {m.name!r} and {other!r} cannot be combined")
        for hook in ("backward", "unscale_grads", "optimizer_step", "zero_grad", "shard_batch", "reduce_loss"):
            owners = [m.name for m in self.members if _overrides(m, hook)]
            if len(owners) > 1:
                raise UsageError(f"strategies {owners[0]!r} and {owners[1]!r} cannot be combined: both replace {hook}")
        self.name = "+".join(names)
        self.distributed = any(m.distributed for m in self.members)
        self.description = "; ".join(m.description for m in self.members)
        self.settings = {}
        self.tolerance = EXACT
        for m in self.members:
            self.tolerance = self.tolerance.loosest(m.tolerance)
        self.context = StepContext(phase="train", device="cpu")

    def _owner(self, hook: str) -> Strategy:
        return next((m for m in self.members if _overrides(m, hook)), Strategy())

    def bind(self, context):
        self.context = context
        for m in self.members:
            m.bind(context)

    def check(self, context):
        for m in self.members:
            m.check(context)

    @contextlib.contextmanager
    def _entered(self, hook: str):
        with contextlib.ExitStack() as stack:
            for m in self.members:
                stack.enter_context(getattr(m, hook)())
            yield

    def session(self):
        return self._entered("session")

    def forward(self):
        return self._entered("forward")

    def prepare_model(self, model, units):
        for m in self.members:
            model = m.prepare_model(model, units)
        return model

    def shard_batch(self, batch):
        return self._owner("shard_batch").shard_batch(batch)

    def wrap_optimizer(self, optimizer, model):
        for m in self.members:
            optimizer = m.wrap_optimizer(optimizer, model)
        return optimizer

    def reduce_loss(self, loss):
        return self._owner("reduce_loss").reduce_loss(loss)

    def backward(self, loss):
        self._owner("backward").backward(loss)

    def unscale_grads(self, optimizer):
        self._owner("unscale_grads").unscale_grads(optimizer)

    def optimizer_step(self, optimizer):
        self._owner("optimizer_step").optimizer_step(optimizer)

    def zero_grad(self, optimizer):
        self._owner("zero_grad").zero_grad(optimizer)

    def end_step(self, kept):
        for m in self.members:
            m.end_step(kept)

    def describe(self):
        described = {}
        for m in self.members:
            described.update(m.describe())
        return described

    def spec(self):
        return "+".join(m.spec() for m in self.members)


def parse_one(text: str) -> Strategy:
    """`name` or `name:opt=value:opt=value` -> a Strategy instance."""
    name, *parts = text.strip().split(":")
    cls = STRATEGIES.get(name)
    return cls(**parse_option_parts("strategy", name, parts, cls.options, text))


def bind_strategy(spec: str, phase: str, device: str, workload: Any = None,
                  ranks: int = 1) -> tuple[Strategy, StepContext]:
    """`parse_strategy(spec)` bound to the case's phase, device, workload and ranks (not yet checked)."""
    strategy = parse_strategy(spec)
    context = StepContext(phase, device, workload, ranks)
    strategy.bind(context)
    return strategy, context


def parse_strategy(spec: str) -> Strategy:
    """`a`, `a:opt=v` or `a+b+c` -> a Strategy (a Composite for several); unknown names raise UsageError."""
    parts = [p for p in spec.split("+") if p.strip()]
    if not parts:
        raise choices_error("strategy", spec, STRATEGIES.names())
    members = [parse_one(p) for p in parts]
    return members[0] if len(members) == 1 else Composite(members)
