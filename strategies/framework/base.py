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
- `rank_signature()` what one rank of a sharded case holds differently from the others (its shard sizes), so that
                   a prediction traces one rank of each kind;
- `describe()`, `differs_by_design()`  the settings it ran with (the row's `strategy_settings`), and why its
                   result cannot be the baseline's;
- `baseline_parameter_name()` the baseline's name of a parameter a transform renamed (peft's LoRA layer keeps the
                   adapted Linear as `base_layer`), so that verification compares it with the right one;
- `replayable_calls()` methods of fake tensors whose memory is a function of their inputs' layout alone (torchao's
                   NF4 dequantisation), which a prediction's memory pass runs once per layout and logs again
                   (bench.measure.call_replay);
- `columns()`      figures it measured itself (compilation time, host memory), written into the row's columns;
                   it declares them in `row_columns` (columns of `bench.core.results.STRATEGY_COLUMNS`).
- `plan_options`    for `python -m bench plan`: the option settings worth trying in a search for the fastest
                   combination under a memory limit (a class attribute; the inherited default tries the defaults,
                   `plan_settings()` computes them where they depend on the case and limit, `PlanSpace`); or
                   `plan_excluded`, why the planner never tries it; `plan_companions()`, the strategies a setting
                   that cannot train alone is tried composed with (tp's meshes: fsdp). Which members compose is
                   what `Composite` accepts (`conflicts`, one owner per replaced hook) and what each member's
                   `check()` accepts.

What the registry-wide tests expect of a strategy is declared on its class too (tests/conformance.py reads it, as
do the docs' strategy table and `list`): `expected` (`MATCHES`, `differs(why)` or `unsupported(why)`) on any
workload, `expected_with` where a workload with a trait gives another outcome (a trait of the workload's model,
`workloads.Trait`, by its value: `batch_norm`, `dropout`, `output_head`...), `memory_effect` (its peak against the
baseline's on captcha_resnet18), `refusals` (the reasons it refuses a case on any device) and `test_spec` (the
spec the tests run it as, where its defaults are too slow for them).

What the report needs to know of a strategy it reads from the row, where the strategy put it: `pitfall = True`
(a habit the articles warn about, measured to show what it costs; listings, tables and the report put those
apart) gives the row's `strategy_role`, and a checkpointing plan declares `recompute_plan_kind` and says what it
recomputes in `recompute_plan()`.

Strategies compose with `+` (`strategies.framework.composite.Composite`); a spec (`checkpoint:segments=4+amp`) is
parsed once into a `StrategySpec` (`strategies.framework.spec`), which builds fresh instances.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields
from typing import Any, Callable, Collection, ContextManager, Hashable

import torch
from torch import nn

from bench.core.errors import Unsupported
from bench.core.options import changed_options, check_option_names
from bench.core.registry import Registry
from bench.core.results import Role

PHASES = ("train", "eval")
DEVICES = ("cpu", "cuda")
PHASE_REFUSAL = r"applies to phase (train|eval) only"  # what check() says of a phase not in `phases`

STRATEGIES: Registry[type["Strategy"]] = Registry("strategy")
register_strategy = STRATEGIES.register


@dataclass(frozen=True)
class Tolerance:
    """How close to the baseline a strategy's loss and gradients must be to count as the same result.

    Gradients are compared parameter by parameter: |grad - ref| / max(|ref|, grad_floor * the largest |ref| of any
    parameter) (norms) must be within `grad_rtol`. The floor is for a gradient that is zero in exact arithmetic
    (an attention key's bias: softmax ignores a shift shared by every key): in float32 it is rounding noise,
    around 1e-9 of the other gradients, whose relative error against itself would be of order 1 for any change in
    the order of the sums. Measured against the largest gradient's norm, that noise is far inside `grad_rtol`;
    a wrong gradient of any parameter whose norm is above the floor is still judged against its own norm.
    """

    loss_rtol: float = 1e-5
    grad_rtol: float = 1e-4  # per parameter (see above); also the BatchNorm statistics' rtol
    grad_floor: float = 1e-3  # the smallest reference norm a gradient is judged against, as a share of the largest
    output_atol: float = 1e-5  # an output (eval) or BatchNorm statistic within this, element by element, matches
    output_rtol: float = 1e-5  # else an output matches when |out - ref| / |ref| (norms) is within this
    step_rtol: float = 1e-4  # per parameter after one optimizer step: |w - ref| / |ref| (norms)

    def loosest(self, other: "Tolerance") -> "Tolerance":
        return Tolerance(**{f.name: max(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)})


# fp32 strategies reorder no arithmetic, or only reorder float sums: they must match to float tolerance.
EXACT = Tolerance()


@dataclass(frozen=True)
class Expected:
    """What a strategy's row is on a workload on the CPU, in the phases it runs in there: it matches the baseline,
    it runs but differs by design (`why`: words of the row's message), or it is `unsupported` (`why`, likewise)."""

    outcome: str  # "matches", "differs" or "unsupported"
    why: str = ""


MATCHES = Expected("matches")


def differs(why: str) -> Expected:
    """The row runs and cannot match the baseline, by design; `why` is in its message."""
    return Expected("differs", why)


def unsupported(why: str) -> Expected:
    """The row is `unsupported` in every phase; `why` is in its message."""
    return Expected("unsupported", why)


@dataclass
class StepContext:
    """What a strategy may need to know about the case it runs in."""

    phase: str
    device: str
    workload: Any = None  # the case's workloads.Workload (its checkpoint units, whether they chain, its spec)
    batch_size: int | None = None
    ranks: int = 1  # processes of torch.distributed the run asks for (--ranks); sharding strategies need 2 or more
    # the compute capability of the CUDA device a prediction is for (predict's --capability/--gpu); None: the device
    # torch sees, if any
    capability: tuple[int, int] | None = None


@dataclass(frozen=True)
class PlanSpace:
    """What a strategy's `plan_options()` may look at: the case the plan is for and the memory limit it must fit."""

    context: StepContext
    budget_bytes: int  # the memory the step may use (after the CUDA context and the headroom)
    gpus_per_node: int = 8  # `plan --gpus-per-node`: a mesh's tensor-parallel groups stay inside a node


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

    def state_floor(self, strategy: "Strategy") -> int | None:
        """A lower bound of the peak of every step of the case under `strategy`, whatever a plan changes of what it
        saves or recomputes: the bytes of the baseline's parameters and optimizer state where `strategy` keeps them
        (`keeps_training_state`); None where it does not, or where they cannot be counted."""
        return None


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
    # whether its training step holds the baseline's parameters and optimizer state on the device as the baseline
    # does (the same tensors: number, dtype, place), changing only activations, gradients' lifetimes or the step's
    # schedule: a plan combination of such strategies cannot fit where those alone cannot (bench.analysis.plan_floor;
    # tests/test_plan_floor.py checks each strategy that says so)
    keeps_training_state = False
    row_columns: tuple[str, ...] = ()  # the columns its `columns()` fills (of bench.core.results.STRATEGY_COLUMNS)
    # a checkpointing plan on its own (`bench.core.results.RECOMPUTE_PLAN_KINDS`): "units" recomputes whole
    # checkpoint units, "operators" the cheap operators of each unit, "none" nothing; None: not a plan
    recompute_plan_kind: str | None = None
    # why `python -m bench plan` never tries this strategy (None: it is a candidate, with its `plan_options`)
    plan_excluded: str | None = None
    # what a prediction of it (predict, plan) assumes that its measurement does not: said in the prediction's row
    prediction_note: str | None = None
    # why a prediction traces every layer of a checkpoint plan of checkpointed then plain layers with it, where it
    # would otherwise build the log from traces at a few layers of each kind (None: it does; bench.analysis.layer_replay)
    layer_kinds_traced_whole: str | None = None
    # the option settings `python -m bench plan` tries ({} is the defaults; see `plan_settings()`)
    plan_options: tuple[dict[str, Any], ...] = ({},)
    # What the tests expect of it on the CPU (tests/conformance.py): its outcome on a workload none of whose traits
    # `expected_with` names; trait -> its outcome on a workload with that trait (the first trait listed that the
    # workload has; `workloads.Trait`'s values); phase -> the band (low, high) of its measured peak over
    # the baseline's on captcha_resnet18 at batch 8 (a phase left out is pinned elsewhere, or not at all);
    # the reasons (regular expressions) its check() refuses a case with on any device (the phase refusal of
    # `phases` and the device refusal of `devices` go without saying); the spec the tests run it as.
    expected: Expected = MATCHES
    expected_with: dict[str, Expected] = {}
    memory_effect: dict[str, tuple[float, float]] = {}
    refusals: tuple[str, ...] = ()
    test_spec: str | None = None

    def __init__(self, **options):
        check_option_names("strategy", self.name, options, self.options)
        self.settings = {**self.options, **options}
        self.context = StepContext(phase="train", device="cpu")

    @classmethod
    def plan_settings(cls, space: PlanSpace) -> list[dict[str, Any]]:
        """The option settings `python -m bench plan` tries for this strategy in `space` (each a dict of options;
        `{}` is the defaults): its `plan_options`, unless it overrides this for settings that depend on the case
        or the limit; an empty list tries none. The planner still drops a setting that `check()` refuses."""
        return [dict(options) for options in cls.plan_options]

    @classmethod
    def plan_companions(cls, options: dict[str, Any], space: PlanSpace) -> list[tuple[str, ...]]:
        """The strategies (specs) that a plan setting of it (`options`) runs composed with, each tuple one
        candidate: `[()]`, none, unless the setting cannot train alone on the space's ranks (tp's dp x tp mesh
        needs fsdp to shard and average over its dp dimension, with or without its mixed precision policy)."""
        return [()]

    @classmethod
    def expected_outcome(cls, traits: Collection[str]) -> Expected:
        """What its row is, on the CPU, on a workload whose model has `traits` (`Workload.traits()`): that of the
        first trait of `expected_with` among them, else `expected`."""
        return next((expected for trait, expected in cls.expected_with.items() if trait in traits), cls.expected)

    @classmethod
    def cpu_phases(cls) -> tuple[str, ...]:
        """The phases it runs in on the CPU in one process: none for a CUDA-only or a sharded strategy."""
        return cls.phases if "cpu" in cls.devices and not cls.distributed else ()

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

    def prepare_loss(self, loss: Callable[[Any, torch.Tensor], torch.Tensor]) -> Callable[[Any, torch.Tensor],
                                                                                         torch.Tensor]:
        """Returns the loss the step computes from the model's float32 output and the target: the workload's `loss`
        or a function in its place (compiled)."""
        return loss

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
        """`kept` holds the loop's variables after the step (output, loss), which the loop releases only when the
        next step rebinds them (the output when the next forward returns, the loss when the next loss exists); may
        drop them (`del pred, loss`)."""

    def plan(self, meter: PlanMeter) -> None:
        """Called once per case after `check()`, before any pass; raises Unsupported when no choice can work."""

    def replayable_calls(self) -> list[tuple[type, str, Callable[[Any], tuple]]]:
        """(class, method name, layout) of the methods whose operators, allocations and frees on fake tensors follow
        from `layout(self)` alone (a hashable key and the tensors the call reads): a prediction's tracked memory
        pass runs each once per layout and logs the same events for its later calls (bench.measure.call_replay)."""
        return []

    def describe(self) -> dict[str, Any]:
        """The settings this strategy ran with, as `name.option -> value` for the result row."""
        return {f"{self.name}.{k}": v for k, v in self.settings.items()}

    def rank_signature(self, rank: int, world: int) -> Hashable | None:
        """After one rank's step of a sharded case: what rank `rank` of `world` holds differently from the other
        ranks, as a value that is equal for two ranks only when their steps allocate exactly the same (a prediction
        then traces one rank of each value, `bench.analysis.fake_engine.tracked_step`); None: not known, that rank
        is traced on its own. A strategy that does nothing differently per rank returns ()."""
        return ()

    def differs_by_design(self) -> str | None:
        """Why, in the bound case, this strategy cannot give the baseline's result (None: it must match it)."""
        return None

    def baseline_parameter_name(self, name: str) -> str:
        """The name the baseline's model gives the parameter named `name` in this strategy's model (the same,
        unless `prepare_model` moved it into a wrapping module); parameters the baseline lacks are not compared."""
        return name

    def columns(self) -> dict[str, Any]:
        """Figures this strategy measured itself, as `column -> value` (only the columns of `row_columns`)."""
        return {}

    def model_owner(self) -> str:
        """How a message names the model this strategy is bound to: `workload 'spec'`, or `the model`."""
        workload = self.context.workload if self.context is not None else None
        return f"workload {workload.spec()!r}" if workload is not None else "the model"

    def spec(self) -> str:
        """The canonical spelling: `name` or `name:opt=value` for options that differ from the default."""
        return ":".join([self.name, *changed_options(self.settings, self.options)])
