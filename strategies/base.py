"""The strategy plug-in API: a small class with hook points, composed by name with `+`.

A strategy is applied only to the stage it concerns (the pyperf hook pattern):
- `session()`      process-wide settings for the whole case, restored on exit (cudnn flags);
- `prepare_model()` transform the model once, before the optimizer sees it (in-place ReLU, checkpointing of the
                   workload's checkpoint units); raises Unsupported when the model gives it nothing to do;
- `wrap_optimizer()` replace or wrap the workload's optimizer once it is made (another algorithm or
                   implementation, per-parameter steps run in backward);
- `load_batch()`   where each step's batch comes from (a pinned host-memory DataLoader);
- `micro_batches()` the pieces one training step runs forward and backward on (gradient accumulation);
- `shard_batch()`  the part of the batch this process trains on (sharded training, one rank of several);
- `forward()`      a context around the forward pass only (autocast, no_grad); the loss runs outside it;
- `backward()`, `optimizer_step()`, `unscale_grads()`, `zero_grad()`  the backward pass and the step (GradScaler);
- `accumulate_loss()` what the loop does with each step's loss for its running total;
- `end_step()`     what the training loop keeps or frees between steps;
- `plan()`         once per case, before any pass: choices that need measuring the case itself (a checkpoint plan
                   under a memory budget), through the `PlanMeter` the runner gives it;
- `describe()`, `differs_by_design()`  the settings it ran with (the row's `strategy_settings`), and why its
                   result cannot be the baseline's;
- `columns()`      figures it measured itself (compilation time, host memory), written into the row's columns;
                   it declares them in `row_columns` (columns of `bench.core.results.STRATEGY_COLUMNS`).

What the report needs to know of a strategy it reads from the row, where the strategy put it: `pitfall = True`
(a habit the articles warn about, measured to show what it costs; listings, tables and the report put those
apart) gives the row's `strategy_role`, and a checkpointing plan declares `recompute_plan_kind` and says what it
recomputes in `recompute_plan()`.

A spec (`checkpoint:segments=4+amp`) is parsed once into a `StrategySpec`, which builds fresh instances.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from bench.core.errors import Unsupported, UsageError, choices_error
from bench.core.options import changed_options, check_option_names, parse_option_parts
from bench.core.registry import Registry
from bench.core.results import Role

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
    step_rtol: float = 1e-4  # per parameter after one optimizer step: |w - ref| / |ref| (norms)

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
    batch_size: int | None = None
    ranks: int = 1  # processes of torch.distributed the run asks for (--ranks); sharding strategies need 2 or more


# One micro-batch of a step: (inputs, target, the factor its loss is multiplied by before backward)
MicroBatch = tuple[Any, torch.Tensor, float]


class PlanMeter:
    """What a strategy's `plan()` may measure about its case; the runner implements it (`bench.run.runner.CaseMeter`)."""

    def predicted_peak(self, strategy: "Strategy") -> int:
        """The peak of one steady-state step of the case under `strategy`, tracked cheaply (on the meta device
        where it can run: shapes only, no arithmetic)."""
        raise NotImplementedError

    def measured_peak(self, strategy: "Strategy") -> int:
        """The peak of one steady-state step of the case under `strategy`, measured on the case's device."""
        raise NotImplementedError

    def baseline_peak(self) -> int:
        """The measured peak of the case's baseline."""
        raise NotImplementedError

    def unit_flops(self) -> list[int]:
        """Floating-point operations of each checkpoint unit's forward (matmul, convolution, attention)."""
        raise NotImplementedError


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
    distributed = False  # runs as `ranks` processes of torch.distributed (bench.run.ranks launches them)
    # How its CPU memory pass counts: "live_tensors" (the exact tracker, a TorchDispatchMode), or
    # "allocator_events" (torch.profiler's allocator events) for steps a dispatch mode would change (torch.compile)
    cpu_memory_count = "live_tensors"
    pitfall = False  # a habit the articles warn about, measured to show what it costs (not a technique)
    row_columns: tuple[str, ...] = ()  # the columns its `columns()` fills (of bench.core.results.STRATEGY_COLUMNS)
    # a checkpointing plan on its own (`bench.core.results.RECOMPUTE_PLAN_KINDS`): "units" recomputes whole
    # checkpoint units, "operators" the cheap operators of each unit, "none" nothing; None: not a plan
    recompute_plan_kind: str | None = None

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

    def role(self) -> str:
        """The row's `strategy_role` (`bench.core.results.Role`): a pitfall, or a technique."""
        return Role.PITFALL.value if self.pitfall else Role.TECHNIQUE.value

    def recompute_plan(self) -> str | None:
        """For a checkpointing plan (`recompute_plan_kind`), what it recomputes, as the plan chart labels it (known
        once its model was prepared; None before); None for any other strategy."""
        return None

    def recomputed_groups(self) -> list[tuple[int, ...]] | None:
        """For a checkpointing plan, the checkpoint units each checkpoint recomputes (known once its model was
        prepared); empty for a plan that recomputes within every unit; None for any other strategy."""
        return None

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        """Returns the optimizer to train with: `optimizer` (the workload's, over `model`) or one replacing it."""
        return optimizer

    def load_batch(self, host_batch: tuple[Any, torch.Tensor], device_batch: tuple[Any, torch.Tensor]
                   ) -> tuple[Any, torch.Tensor]:
        """The (inputs, target) of one step; `host_batch` is the same batch in host memory (default: the batch
        moved to the device once, before any step)."""
        return device_batch

    def micro_batches(self, inputs: Any, target: torch.Tensor) -> list[MicroBatch]:
        """The pieces a training step runs forward and backward on before its one optimizer step."""
        return [(inputs, target, 1.0)]

    def shard_batch(self, batch: tuple[Any, torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """The part of the step's `(inputs, target)` this process trains on (all of it, unless sharded)."""
        return batch

    def forward(self) -> ContextManager:
        """A context around the forward pass only."""
        return contextlib.nullcontext()

    def reduce_loss(self, loss: float) -> float:
        """The loss of the whole step's batch from this process's, for the comparison with the baseline (an
        average across ranks when each trained on a shard)."""
        return loss

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

    def accumulate_loss(self, loss_of_step: Callable[[], torch.Tensor]) -> None:
        """Adds the step's loss to the loop's running total; `loss_of_step()` computes it (in eval, where the step
        itself computes none). The baseline keeps no total: a `loss.item()` would synchronise inside the timed step."""

    def end_step(self, kept: dict[str, Any]) -> None:
        """`kept` holds what the article's loop keeps alive until the next step (output, loss); may drop it."""

    def plan(self, meter: PlanMeter) -> None:
        """Called once per case after `check()`, before any pass; raises Unsupported when no choice can work."""

    def describe(self) -> dict[str, Any]:
        """The settings this strategy ran with, as `name.option -> value` for the result row."""
        return {f"{self.name}.{k}": v for k, v in self.settings.items()}

    def differs_by_design(self) -> str | None:
        """Why, in the bound case, this strategy cannot give the baseline's result (None: it must match it)."""
        return None

    def columns(self) -> dict[str, Any]:
        """Figures this strategy measured itself, as `column -> value` (only the columns of `row_columns`)."""
        return {}

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
        for hook in ("load_batch", "micro_batches", "backward", "unscale_grads", "optimizer_step", "zero_grad",
                     "shard_batch", "reduce_loss"):
            owners = [m.name for m in self.members if _overrides(m, hook)]
            if len(owners) > 1:
                raise UsageError(f"strategies {owners[0]!r} and {owners[1]!r} cannot be combined: both replace {hook}")
        self.name = "+".join(names)
        self.distributed = any(m.distributed for m in self.members)
        self.pitfall = any(m.pitfall for m in self.members)
        self.row_columns = tuple(column for m in self.members for column in m.row_columns)
        counts = {m.cpu_memory_count for m in self.members} - {"live_tensors"}
        self.cpu_memory_count = counts.pop() if counts else "live_tensors"
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

    def load_batch(self, host_batch, device_batch):
        return self._owner("load_batch").load_batch(host_batch, device_batch)

    def micro_batches(self, inputs, target):
        return self._owner("micro_batches").micro_batches(inputs, target)

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

    def accumulate_loss(self, loss_of_step):
        for m in self.members:
            m.accumulate_loss(loss_of_step)

    def end_step(self, kept):
        for m in self.members:
            m.end_step(kept)

    def differs_by_design(self):
        reasons = [reason for m in self.members if (reason := m.differs_by_design())]
        return "; ".join(reasons) or None

    def recomputed_groups(self):
        return next((groups for m in self.members if (groups := m.recomputed_groups()) is not None), None)

    def plan(self, meter):
        for m in self.members:
            m.plan(_MemberMeter(meter, self, m))

    def describe(self):
        described = {}
        for m in self.members:
            described.update(m.describe())
        return described

    def columns(self):
        measured = {}
        for m in self.members:
            measured.update(m.columns())
        return measured

    def spec(self):
        return "+".join(m.spec() for m in self.members)


class _MemberMeter(PlanMeter):
    """A member's view of its composite's meter: a candidate for the member is measured with the other members."""

    def __init__(self, meter: PlanMeter, composite: Composite, member: Strategy):
        self.meter, self.composite, self.member = meter, composite, member

    def _with(self, candidate: Strategy) -> Strategy:
        combined = Composite([candidate if m is self.member else m for m in self.composite.members])
        combined.context = self.composite.context
        return combined

    def predicted_peak(self, strategy):
        return self.meter.predicted_peak(self._with(strategy))

    def measured_peak(self, strategy):
        return self.meter.measured_peak(self._with(strategy))

    def baseline_peak(self):
        return self.meter.baseline_peak()

    def unit_flops(self):
        return self.meter.unit_flops()


def _parse_member(text: str) -> tuple[type[Strategy], tuple[tuple[str, Any], ...]]:
    """`name` or `name:opt=value:opt=value` -> the strategy's class and its options."""
    name, *parts = text.strip().split(":")
    cls = STRATEGIES.get(name)
    return cls, tuple(parse_option_parts("strategy", name, parts, cls.options, text).items())


@dataclass(frozen=True)
class _ParsedSpec:
    members: tuple[tuple[type[Strategy], tuple[tuple[str, Any], ...]], ...]
    canonical: str
    role: str
    recompute_plan_kind: str | None


class StrategySpec(str):
    """A strategy spec (`a`, `a:opt=v`, `a+b+c`) parsed once: it is the text as given, and holds each member's
    class and options once parsed, so that `build()` makes fresh instances without parsing the text again.

    A `str`, so that a case holding one (`bench.run.case.Case.strategy`) still prints, compares, hashes and
    serialises as its text; `spec()` is the canonical spelling rows use (members in composition order, options
    at their default left out). It is parsed on first use, not when made: a strategy that a plugin registers in
    worker processes only ($MEMBENCH_PLUGINS) is unknown to the process that starts them, which only passes the
    text on. There `build()` raises UsageError, `spec()` is the text and `role`/`recompute_plan_kind` are None
    (the worker's row has them)."""

    _parsed: _ParsedSpec | None

    def __new__(cls, text: str) -> "StrategySpec":
        if isinstance(text, StrategySpec):
            return text
        self = super().__new__(cls, text)
        self._parsed = None
        return self

    def parsed(self) -> _ParsedSpec:
        """The members' classes and options, the canonical spelling and what the strategy declares; UsageError for
        an unknown name or a bad option."""
        if self._parsed is None:
            parts = [p for p in self.split("+") if p.strip()]
            if not parts:
                raise choices_error("strategy", str(self), STRATEGIES.names())
            members = tuple(_parse_member(part) for part in parts)
            built = _build(members)  # also checks the composition (conflicts, a strategy named twice)
            self._parsed = _ParsedSpec(members, built.spec(), built.role(), built.recompute_plan_kind)
        return self._parsed

    def build(self) -> Strategy:
        """A fresh, unbound instance (a Composite for several members)."""
        return _build(self.parsed().members)

    def _known(self) -> _ParsedSpec | None:
        try:
            return self.parsed()
        except UsageError:
            return None

    def spec(self) -> str:
        known = self._known()
        return str(self) if known is None else known.canonical

    @property
    def role(self) -> str | None:
        """The strategy's `role()` (`bench.core.results.Role`), None where it is unknown to this process."""
        known = self._known()
        return None if known is None else known.role

    @property
    def recompute_plan_kind(self) -> str | None:
        known = self._known()
        return None if known is None else known.recompute_plan_kind

    def __reduce__(self):
        return StrategySpec, (str(self),)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


def _build(members: tuple[tuple[type[Strategy], tuple[tuple[str, Any], ...]], ...]) -> Strategy:
    strategies = [cls(**dict(options)) for cls, options in members]
    return strategies[0] if len(strategies) == 1 else Composite(strategies)


def parse_one(text: str) -> Strategy:
    """`name` or `name:opt=value:opt=value` -> a Strategy instance."""
    cls, options = _parse_member(text)
    return cls(**dict(options))


def bind_strategy(spec: str, phase: str, device: str, workload: Any = None,
                  batch_size: int | None = None, ranks: int = 1) -> tuple[Strategy, StepContext]:
    """A fresh instance of `spec` (a StrategySpec, or text parsed here) bound to the case's phase, device, workload,
    batch size and the run's ranks (not yet checked)."""
    strategy = StrategySpec(spec).build()
    context = StepContext(phase, device, workload, batch_size, ranks)
    strategy.bind(context)
    return strategy, context


def parse_strategy(spec: str) -> Strategy:
    """`a`, `a:opt=v` or `a+b+c` -> a Strategy (a Composite for several); unknown names raise UsageError."""
    return StrategySpec(spec).build()
