"""Activation checkpointing over the workload's checkpoint units (checkpoint_sequential semantics), BatchNorm-safe."""

from __future__ import annotations

import contextlib
import math
import time
import weakref

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bench.core.errors import Unsupported, UnsupportedValue, UsageError
from bench.core.units import format_size, fraction_or_size, parse_positive_size
from strategies import PlanMeter, Strategy, register_strategy


def batchnorm_buffers(model: nn.Module) -> list[torch.Tensor]:
    """running_mean, running_var and num_batches_tracked of every BatchNorm in `model`."""
    return [b for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) for b in m.buffers()]


@contextlib.contextmanager
def preserved(buffers: list[torch.Tensor]):
    """Restores `buffers` on exit to what they were on entry (also on an exception, e.g. checkpoint's early stop of
    a recompute). Written through `.data`, whose writes do not bump the buffer's version counter: a BatchNorm
    outside the recomputed segment may have saved the buffer for its backward, which would fail on a bumped
    version (the batch-norm kernel itself updates running statistics without bumping it). Every buffer is copied
    back, changed or not: finding the changed ones by value (`torch.equal`) would make the host wait for the GPU
    once per buffer in every recompute, inside the timed backward."""
    if any(b.is_meta for b in buffers):  # shapes only (a plan's memory on meta): no values to change or restore
        yield
        return
    saved = [b.detach().clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, s in zip(buffers, saved):
                b.data.copy_(s)


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


class UnitCheckpointer:
    """Checkpoints groups of a model's units in place, by replacing each group's `forward` (checkpoint_sequential
    semantics over any model: the units need not be the whole forward, only blocks that the model calls).

    A group of consecutive units that chain (the output of one is the input of the next and nothing else) is one
    checkpoint: its first unit runs the whole chain, the others pass their input through (checked: a model that
    does not feed them the chain's output raises). Units that do not chain are checkpointed one by one. Only in
    training with autograd on; otherwise the units run plainly.

    `bn_fix`: the recomputation in backward runs each BatchNorm's training-mode forward a second time, which would
    update running_mean/var again and count num_batches_tracked twice. With the fix, the recompute restores every
    BatchNorm buffer to what it was when the recompute began. `checkpoint_sequential` in this torch does not pass
    `context_fn` on, hence the segmenting here. Random state (dropout) is replayed by checkpoint itself
    (`preserve_rng_state`), so the recompute draws the same masks.
    """

    def __init__(self, model: nn.Module, reentrant: bool = False, bn_fix: bool = True, context_fn=None):
        self.model = model
        self.reentrant = reentrant
        self.bn_fix = bn_fix
        self._bn_buffers = batchnorm_buffers(model) if bn_fix else []
        # (forward context, recompute context) for each checkpoint, e.g. a selective-checkpoint policy's
        self._inner_context_fn = context_fn

    def _context_fn(self):
        if self._inner_context_fn is None:
            return contextlib.nullcontext(), preserved(self._bn_buffers)
        forward, recompute = self._inner_context_fn()
        return forward, _both(preserved(self._bn_buffers), recompute)  # its clones outside the policy

    def _reentrant_fn(self, function):
        calls = [0]  # the first call is the forward; any later one is the recompute in backward

        def run(*args):
            calls[0] += 1
            if calls[0] == 1 or not self.bn_fix:
                return function(*args)
            with preserved(self._bn_buffers):
                return function(*args)
        return run

    def checkpointed(self, function, *args, **kwargs):
        """`function(*args, **kwargs)`, its activations recomputed in backward (in training with autograd on)."""
        if not (self.model.training and torch.is_grad_enabled()):
            return function(*args, **kwargs)
        if self.reentrant:
            return checkpoint(self._reentrant_fn(function), *args, use_reentrant=True)
        # under torch.compile the recomputation is the partitioner's, which never replays a buffer's update: no
        # BatchNorm fix, and only a context torch.compile takes (a function of two dispatch modes, not a method)
        if self._bn_buffers and not torch.compiler.is_compiling():
            return checkpoint(function, *args, use_reentrant=False, context_fn=self._context_fn, **kwargs)
        if self._inner_context_fn is not None:
            return checkpoint(function, *args, use_reentrant=False, context_fn=self._inner_context_fn, **kwargs)
        return checkpoint(function, *args, use_reentrant=False, **kwargs)

    def install(self, group: list[nn.Module]) -> None:
        """Makes `group` (consecutive units that chain) one checkpoint."""
        forwards = [unit.forward for unit in group]
        last_output: list = [None]  # a weak reference to what the group's first unit returned

        def run_chain(*args, **kwargs):
            x = forwards[0](*args, **kwargs)
            for forward in forwards[1:]:
                x = forward(x)
            return x

        def first(*args, **kwargs):
            out = self.checkpointed(run_chain, *args, **kwargs)
            last_output[0] = weakref.ref(out) if isinstance(out, torch.Tensor) else None
            return out

        def passed_through(x, *rest, **kwargs):
            if rest or kwargs or last_output[0] is None or last_output[0]() is not x:
                raise RuntimeError("checkpoint units do not chain: a unit inside a checkpointed segment was not "
                                   "called with the previous unit's output (set the workload's units_chain = False)")
            return x

        group[0].forward = first
        for unit in group[1:]:
            unit.forward = passed_through


Plan = tuple[tuple[int, ...], ...]  # the checkpoints, each a tuple of consecutive unit indices


def segment_plan(units: int, segments: int, chain: bool) -> Plan:
    """checkpoint_sequential's plan: `segments` chunks of units // segments units, all but the last
    checkpointed; a chunk is one checkpoint when its units chain, else each unit is its own."""
    size = units // segments
    groups = [tuple(range(start, start + size)) for start in range(0, size * (segments - 1), size)]
    return tuple(groups) if chain else tuple((unit,) for group in groups for unit in group)


def every_unit_plan(units: int) -> Plan:
    """Every unit its own checkpoint, none left to run plainly: what transformers' `gradient_checkpointing_enable`
    and torchtune's `enable_activation_checkpointing` do to each decoder layer (chained or not: a checkpoint per
    unit keeps each unit's input and recomputes one unit at a time in backward)."""
    return tuple((unit,) for unit in range(units))


def sqrt_segments(units: int) -> int:
    """Chen et al. (2016): about sqrt(N) segments of about sqrt(N) units each, so that the segment inputs kept and
    the one segment recomputed at a time both grow like sqrt(N)."""
    return max(1, min(units, round(math.sqrt(units))))


def format_plan(plan: Plan) -> str:
    """`0-4 5-9` (each checkpoint's first-last unit), `0 1 2` for single units, `none` for no checkpoint."""
    if not plan:
        return "none"
    return " ".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else f"{g[0]}" for g in plan)


def recomputed_units(plan: Plan) -> list[int]:
    return [unit for group in plan for unit in group]


# Plans the budget search considers: every checkpoint_sequential plan with up to this many segments beyond
# sqrt(N) (past it, more segments keep more segment inputs and recompute more), and for models of up to
# PREFIX_MAX_UNITS units also the first j checkpoints of each (the early, high-resolution units of a CNN hold
# the largest activations: checkpointing only them can fit a budget at less recompute).
PREFIX_MAX_UNITS = 16


def candidate_plans(units: int, chain: bool) -> list[Plan]:
    """The plans the budget search considers, without duplicates (see PREFIX_MAX_UNITS), the every-unit plan last."""
    most = units if units <= PREFIX_MAX_UNITS else min(units, 4 * math.ceil(math.sqrt(units)))
    plans: dict[Plan, None] = {(): None}
    for segments in range(2, most + 1):
        full = segment_plan(units, segments, chain)
        if units <= PREFIX_MAX_UNITS:
            for j in range(1, len(full)):
                plans.setdefault(full[:j])
        plans.setdefault(full)
    plans.setdefault(every_unit_plan(units))
    return list(plans)


def parse_budget(text: str) -> tuple[float | None, int | None]:
    """`0.6` -> (0.6, None), a fraction of the baseline's peak; `300MiB` -> (None, bytes). UsageError otherwise."""
    fraction = fraction_or_size(text)
    if fraction is not None:
        return fraction, None
    try:
        return None, parse_positive_size(text)
    except ValueError as error:
        raise UsageError(f"checkpoint:budget={text}: {error}; give a size (300MiB) or a fraction of the baseline's "
                         "peak in (0, 1]") from None


@register_strategy
class Checkpoint(Strategy):
    """Activation checkpointing: keep only each segment's input, recompute the segment in backward.

    Options:
    - `segments` (default `auto`): how many chunks the workload's N checkpoint units are cut into, of `N // segments`
      units each; all but the last are checkpointed (the rest runs plainly). A number, `sqrt` (round(sqrt(N)),
      Chen et al. 2016: activation memory grows like sqrt(N) instead of N), `auto` = min(6, N), or `all`: every
      unit its own checkpoint and none left unchecked (N checkpoints where `segments=N` makes N - 1), as
      transformers' `gradient_checkpointing_enable` and torchtune's `enable_activation_checkpointing` checkpoint
      every decoder layer of an `hf:` model; the row's settings give the number used. More segments than units is
      an `unsupported` row. 6 was chosen on the
      captcha ResNet's 10 units (stem, 8 blocks, head). Evidence: train peak
      of live tensor bytes at batch 8 on the CPU (exact tracker, synthetic data; baseline 221,420,444, of which
      ~180 MB are weights, gradients and Adam state, so only ~40 MB are activations to save):
        segments  1: 221,420,444 (nothing checkpointed)   2: 220,082,748   3: 212,546,108
        segments  4: 201,993,276 (6 stages recomputed)     5: 201,993,276 (8 recomputed)
        segments  6: 201,534,524 (5 stages recomputed: stem + 4 high-resolution blocks)
        segments 7..10: 201,534,524 (6..9 stages recomputed)
      6 gives the lowest peak seen with the fewest recomputed stages (the first, high-resolution stages hold most
      of the activations; checkpointing the later, small ones saves nothing more and costs recompute).
    - `budget` (default none): a peak to fit, as a size (`300MiB`) or a fraction of the baseline's measured peak
      (`0.6`). Before the case runs, `plan()` tries the candidate plans (`candidate_plans`) in order of recompute
      cost (the forward FLOPs of the units they recompute, from one step on the meta device), predicts each one's
      peak with the exact tracker on the meta device (seconds, at any batch), takes the first that fits and
      confirms it with a measured step on the case's device (a miss goes on to the next plan). The row records the
      plan (`checkpoint.plan`: the units of each checkpoint), the recomputed FLOPs, the predicted peak
      (`predicted_peak_bytes`) beside the measured one. No plan fitting is an `unsupported` row that gives the
      smallest peak reachable. `budget` replaces `segments`.
    - `reentrant` (default False) and `bn_fix` (default True) exist to demonstrate two traps, not for use:
      `reentrant=true` checkpoints with the reentrant autograd.Function, which, fed the batch (an input that does
      not require grad), returns an output that does not require grad, so the checkpointed segments' parameters
      get no gradient (verification shows params_without_grad > 0); `bn_fix=false` lets the recompute update the
      BatchNorm statistics a second time (verification shows bn_stats_match False).
    Exact: the recompute repeats the same fp32 arithmetic.

    Limitations: it recomputes only the workload's checkpoint units (`Workload.checkpoint_units`): a model
    that names fewer than 2 (1 with `segments=all`), or fewer than `segments`, is an `unsupported` row, and what lies
    outside the units (an embedding, a head the model does not list) is never recomputed. Units that do not chain (a
    UNet's blocks, an `hf:` model's layers) are each their own checkpoint: no segment spans several. In eval, or with
    autograd off, the units run plainly: nothing is saved for a backward, so nothing changes. `budget` plans only where
    a command plans before running the case (`compare`, `run`, `explain`; elsewhere the row is `unsupported`), and a
    budget no candidate plan fits is an `unsupported` row giving the smallest peak it reached.
    """

    name = "checkpoint"
    keeps_training_state = True
    row_columns = ("predicted_peak_bytes",)
    recompute_plan_kind = "units"
    description = "activation checkpointing of the workload's checkpoint units (non-reentrant, BatchNorm statistics kept once)"
    options = {"segments": "auto", "budget": "", "reentrant": False, "bn_fix": True}
    auto_segments = 6
    priority = 30  # wraps the model after in-place ReLU changed it
    # Train 221,420,444 -> 201,534,524 (0.910, segments=6) on captcha_resnet18. At batch 8 ~180 MB of the peak are
    # weights, grads and Adam state, so the ~40 MB of activations are all checkpointing can touch.
    memory_effect = {"train": (0.85, 0.95)}
    refusals = (r"exceeds the \d+ checkpoint units", r"checkpoint:budget plans from one process's step")

    @classmethod
    def plan_settings(cls, space):
        """Every unit (the published recipes' plan: transformers' gradient_checkpointing, torchtune's and
        torchtitan's full activation checkpointing), first: the one the search combines before the others; then
        the default plan, the sqrt(N) plan, and the plan of least recompute that fits the planner's limit."""
        return [{"segments": "all"}, {}, {"segments": "sqrt"}, {"budget": f"{space.budget_bytes // 2**20}MiB"}]

    def __init__(self, **options):
        super().__init__(**options)
        segments = str(self.settings["segments"])
        # at most 9 digits: int() of a longer text may exceed Python's digit limit, and no model has that many units
        if segments not in ("auto", "sqrt", "all") and not (segments.isdigit() and len(segments) <= 9
                                                            and int(segments) >= 1):
            raise UsageError(f"checkpoint:segments={segments} must be a positive integer, sqrt, auto or all")
        self.budget_fraction, self.budget_bytes = (None, None)
        if self.settings["budget"]:
            if segments != "auto":
                raise UsageError("checkpoint: give segments or budget, not both (a budget chooses the plan)")
            self.budget_fraction, self.budget_bytes = parse_budget(self.settings["budget"])
        self.plan_used: Plan | None = None  # fixed by plan() under a budget; otherwise set by prepare_model
        self.segments_used: int | str | None = None  # "all": every unit its own checkpoint
        self.predicted_peak_bytes: int | None = None
        self.recompute_flops: int | None = None
        self.planning_s: float | None = None

    def segments_for(self, units: int) -> int:
        """The number of segments over `units` checkpoint units."""
        segments = str(self.settings["segments"])
        if segments == "auto":
            return min(self.auto_segments, units)
        if segments == "all":
            return units
        return sqrt_segments(units) if segments == "sqrt" else int(segments)

    def check(self, context):
        super().check(context)
        if self.settings["budget"] and context.ranks > 1:
            # its plan predicts the composed step in this process, outside the ranks' process group, where a sharded
            # strategy cannot build its mesh
            raise Unsupported(f"checkpoint:budget plans from one process's step, not a sharded step on --ranks "
                              f"{context.ranks}: give checkpoint:segments (all, sqrt or a number)")
        segments = str(self.settings["segments"])
        if segments.isdigit() and not self.settings["budget"] and context.workload is not None:
            units = context.workload.checkpoint_unit_count()
            if int(segments) > units:
                raise UnsupportedValue(f"checkpoint:segments={segments} exceeds the {units} checkpoint units of "
                                       f"workload {context.workload.spec()!r}")

    def _chain(self) -> bool:
        workload = self.context.workload
        return workload.units_chain if workload is not None else True

    def with_plan(self, plan: Plan) -> "Checkpoint":
        """This strategy with `plan` fixed (a candidate of the budget search)."""
        candidate = Checkpoint(**{k: v for k, v in self.settings.items() if k != "budget"})
        candidate.bind(self.context)
        candidate.plan_used = plan
        return candidate

    def plan(self, meter: PlanMeter) -> None:
        if self.budget_fraction is None and self.budget_bytes is None:
            return
        if self.context.phase != "train":
            raise Unsupported(f"checkpoint:budget plans what backward recomputes; in {self.context.phase} there is "
                              "no backward, so no plan changes the peak")
        started = time.perf_counter()
        units = self.context.workload.checkpoint_unit_count()  # counted without building the real model
        if units < 2:
            raise Unsupported(f"checkpoint needs at least 2 checkpoint units; {self.model_owner()} names {units}")
        if self.budget_bytes is None:
            self.budget_bytes = int(self.budget_fraction * meter.baseline_peak())
        floor = meter.state_floor(self)
        if floor is not None and floor > self.budget_bytes:
            # no plan to predict: each would be a full trace (19 of llama-3.1-70b at 80 layers, a minute of a plan)
            raise Unsupported(f"checkpoint:budget={self.settings['budget']} ({format_size(self.budget_bytes)}): no "
                              f"plan can fit: every step holds the parameters and optimizer state "
                              f"({format_size(floor)}, counted on meta), whatever it recomputes")
        flops = meter.unit_flops()
        plans = sorted(candidate_plans(units, self._chain()),
                       key=lambda p: (sum(flops[u] for u in recomputed_units(p)), len(recomputed_units(p)), len(p)))
        smallest: tuple[int, Plan] | None = None
        for plan in plans:
            candidate = self.with_plan(plan)
            predicted = meter.predicted_peak(candidate)
            if smallest is None or predicted < smallest[0]:
                smallest = (predicted, plan)
            if predicted <= self.budget_bytes and meter.measured_peak(candidate) <= self.budget_bytes:
                self.plan_used, self.predicted_peak_bytes = plan, predicted
                self.recompute_flops = sum(flops[u] for u in recomputed_units(plan))
                self.planning_s = time.perf_counter() - started
                return
        raise Unsupported(f"checkpoint:budget={self.settings['budget']} ({format_size(self.budget_bytes)}): no "
                          f"plan of {len(plans)} fits; the smallest peak reachable is {format_size(smallest[0])} "
                          f"(plan {format_plan(smallest[1])}, predicted on meta)")

    def prepare_model(self, model, units):
        every_unit = str(self.settings["segments"]) == "all"
        if len(units) < (1 if every_unit else 2):  # one segment of several units would leave it unchecked
            needed = "a checkpoint unit" if every_unit else "at least 2 checkpoint units"
            raise Unsupported(f"checkpoint needs {needed}; {self.model_owner()} names {len(units)}")
        if self.plan_used is None and every_unit:
            self.plan_used, self.segments_used = every_unit_plan(len(units)), "all"
        elif self.plan_used is None:
            if self.settings["budget"]:
                raise Unsupported("checkpoint:budget chooses its plan per case before the case runs "
                                  "(`compare`, `run`, `explain`); this command does not plan")
            segments = self.segments_for(len(units))
            if segments > len(units):
                raise Unsupported(f"checkpoint:segments={segments} exceeds the {len(units)} checkpoint units of "
                                  f"{self.model_owner()}")
            self.plan_used = segment_plan(len(units), segments, self._chain())
            self.segments_used = segments
        checkpointer = UnitCheckpointer(model, reentrant=self.settings["reentrant"], bn_fix=self.settings["bn_fix"])
        for group in self.plan_used:
            checkpointer.install([units[i] for i in group])
        return model

    def describe(self):
        described = super().describe()
        if self.segments_used is not None:
            described["checkpoint.segments"] = self.segments_used
        if self.plan_used is not None:
            described["checkpoint.plan"] = format_plan(self.plan_used)
        if self.settings["budget"]:
            described["checkpoint.segments"] = "budget"
            described["checkpoint.budget_bytes"] = self.budget_bytes
            described["checkpoint.recompute_flops"] = self.recompute_flops
            described["checkpoint.planning_s"] = None if self.planning_s is None else round(self.planning_s, 2)
        return described

    def recompute_plan(self):
        return None if self.plan_used is None else format_plan(self.plan_used)

    def recomputed_groups(self):
        return None if self.plan_used is None else [tuple(group) for group in self.plan_used]

    def columns(self):
        return {"predicted_peak_bytes": self.predicted_peak_bytes} if self.predicted_peak_bytes is not None else {}
