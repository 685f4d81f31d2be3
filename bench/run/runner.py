"""Runs cases: each one verified against the baseline, timed, and measured for memory, in separate passes.

A case is (workload, strategy, phase, batch size, device). Every pass starts from a fresh session built from
the same seed, so each strategy sees the same initial weights and the same batch as the baseline.
"""

from __future__ import annotations

import functools
import gc
import random
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import pandas as pd
import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_map
from torch.utils.hooks import RemovableHandle

from bench.core import progress
from bench.core.errors import Unsupported, UsageError
from bench.core.results import SCHEMA_VERSION, new_run_id, now_iso, write_csv_atomic, write_rows
from bench.measure import breakdown, memory, timing
from bench.measure.env import emulated_on_cpu, environment
from bench.measure.fake_cuda_mode import clear_on_fake_mode_change
from bench.measure.stats import summarize_timing
from bench.run.isolation import RunOptions, process_state, run_in_worker
from bench.run.ranks import in_rank_process, run_on_ranks
from bench.run.rule_of_thumb import rule_of_thumb
from strategies import StepContext, Strategy, bind_strategy
from strategies.base import PlanMeter
from workloads import get_workload
from workloads.base import tensors_of, to_device, to_float32

# Steps before the measured one: one makes Adam's state and the kept output of the previous step exist; CUDA
# gets a second so that cuDNN's autotuning and the allocator's first-step behaviour are behind it.
MEMORY_WARMUP_STEPS = {"cpu": 1, "cuda": 2}


@dataclass(frozen=True)
class Case:
    """One measured configuration. `workload` is a workload spec (`deep_mlp:layers=100`, `file.py:NAME`)."""

    workload: str
    strategy: str
    phase: str
    batch_size: int
    device: str
    data: str | None = None  # None: the workload's default data source (its first)
    warmup: int = 3
    steps: int | None = 10  # exactly this many timed steps; None: adaptive, as the three below say
    min_steps: int = 5
    max_time_s: float = 60.0  # seconds of timed steps per repeat, at most (plus the step that crosses it)
    target_ci_rel: float = 0.05

    def __post_init__(self):
        if self.data is None:
            object.__setattr__(self, "data", get_workload(self.workload).data_sources[0])

    def label(self) -> str:
        return f"{self.workload} {self.strategy} {self.phase} bs={self.batch_size} {self.device}"

    def timing_policy(self) -> timing.TimingPolicy:
        """How the timing pass of this case decides how many steps to time (bench.measure.timing.TimingPolicy)."""
        return timing.TimingPolicy(self.warmup, self.steps, self.min_steps, self.max_time_s, self.target_ci_rel)


@functools.lru_cache(maxsize=8)
def _cpu_batch(workload_spec: str, batch_size: int, data: str):
    return get_workload(workload_spec).make_batch(batch_size, data)


def seed_everything(seed: int) -> None:
    """Seeds as the article's cookbook does: torch, Python's random, and every CUDA device."""
    torch.manual_seed(seed)
    random.seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def bind_case(case: Case, ranks: int = 1) -> tuple[Strategy, StepContext]:
    """The case's strategy parsed and bound to its phase, device, (resolved) workload, batch size and the run's
    ranks; not yet checked."""
    return bind_strategy(case.strategy, case.phase, case.device, get_workload(case.workload), case.batch_size, ranks)


def _no_mark(stage: str) -> None:
    pass


class Session:
    """A fresh model, optimizer, loss and batch for one pass of one case, with the strategy applied.

    The steps are the article's loop, the same for every workload: the workload says what to train (model,
    batch, loss, optimizer), the strategy how (its hooks), and this class runs it. With `observe_grads`,
    `watch_grads()` callbacks see each gradient as it is accumulated, before any hook of the strategy (which may
    step and free it at once); the timed passes leave it off, so that their steps hold nothing but the step.
    """

    def __init__(self, case: Case, strategy: Strategy, observe_grads: bool = False):
        self.workload = workload = get_workload(case.workload)
        seed_everything(workload.seed)
        self.case = case
        self.strategy = strategy
        self.base_model = self.place(workload.build_model())
        self.observe_grads = observe_grads
        self._grad_watchers: OrderedDict[int, Callable[[torch.Tensor], None]] = OrderedDict()  # RemovableHandle's
        if observe_grads:
            watchers = self._grad_watchers

            # A hook that held the session would make a cycle (parameter -> hook -> session -> model ->
            # parameter) that only the cyclic collector frees: every pass's model and state would linger.
            def grad_ready(param: torch.Tensor) -> None:
                for watcher in list(watchers.values()):
                    watcher(param)

            for param in self.base_model.parameters():
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(grad_ready)
        self.model = strategy.prepare_model(self.base_model, workload.checkpoint_units(self.base_model))
        self.optimizer = strategy.wrap_optimizer(workload.make_optimizer(self.base_model), self.base_model)
        self.host_batch = strategy.shard_batch(self.load_host_batch())
        inputs, target = self.host_batch
        self.x, self.y = self.place(inputs), self.place(target)
        self.model.train(case.phase == "train")
        self.kept: dict[str, Any] = {}  # what the article's loop keeps alive until the next step
        # dropout draws from the global generator: every pass starts its steps from the same random state
        seed_everything(workload.seed + 1)

    def place(self, value: Any) -> Any:
        """The freshly built model, or a (nested) batch, on the case's device (a hook point: the fake-tensor
        engine, `bench.analysis.fake_engine.FakeSession`, keeps what it built as fake tensors instead)."""
        if isinstance(value, torch.nn.Module):
            return value.to(self.case.device)
        return to_device(value, self.case.device)

    def load_host_batch(self) -> Any:
        """The whole batch of the case in host memory, before the strategy shards it (a hook point)."""
        return _cpu_batch(self.case.workload, self.case.batch_size, self.case.data)

    def forward(self, inputs: Any = None) -> Any:
        """The model's output on `inputs` (default: the session's batch), inside the strategy's forward context."""
        with self.strategy.forward():
            return self.workload.run_model(self.model, self.x if inputs is None else inputs)

    def loss(self, predicted: Any, target: torch.Tensor | None = None) -> torch.Tensor:
        """The workload's loss on the output in float32 (losses are not autocast-safe), outside autocast."""
        return self.workload.loss(to_float32(predicted), self.y if target is None else target)

    def batch(self) -> tuple[Any, torch.Tensor]:
        """The (inputs, target) of one step, from where the strategy loads it."""
        return self.strategy.load_batch(self.host_batch, (self.x, self.y))

    def forward_backward(self, mark: Callable[[str], None] = _no_mark,
                         seen: Callable[[Any, torch.Tensor], None] | None = None) -> tuple[Any, torch.Tensor]:
        """Forward, loss and backward on each of the strategy's micro-batches of one step's batch (the whole batch
        unless it splits it), each loss weighted as it says; returns the last micro-batch's output and loss, as
        the loop's variables hold them after it. `seen(output, weighted loss)` is told of each micro-batch."""
        s = self.strategy
        for inputs, target, weight in s.micro_batches(*self.batch()):
            mark("forward")
            predicted = self.forward(inputs)
            loss = self.loss(predicted, target)
            if weight != 1:
                loss = loss * weight
            mark("backward")
            s.backward(loss)
            if seen is not None:
                seen(predicted, loss)
        return predicted, loss

    def step(self, mark: Callable[[str], None] = _no_mark) -> None:
        """One step of the case's phase; `mark` is told when the forward, backward and optimizer stages begin."""
        if self.case.phase == "train":
            self.train_step(mark)
        else:
            self.eval_step(mark)

    def train_step(self, mark: Callable[[str], None] = _no_mark) -> None:
        """The article's training step: forward, loss, backward (per micro-batch), optimizer step, zero_grad."""
        s = self.strategy
        predicted, loss = self.forward_backward(mark)
        mark("optimizer")
        s.optimizer_step(self.optimizer)
        s.zero_grad(self.optimizer)
        self.kept["predicted"], self.kept["loss"] = predicted, loss
        s.accumulate_loss(lambda: loss)
        s.end_step(self.kept)

    def eval_step(self, mark: Callable[[str], None] = _no_mark) -> None:
        """The article's validation step: the model in eval mode, one forward pass (autograd as the strategy says)."""
        mark("forward")
        inputs, target = self.batch()
        predicted = self.kept["predicted"] = self.forward(inputs)
        self.strategy.accumulate_loss(lambda: self.loss(predicted, target))
        self.strategy.end_step(self.kept)

    def watch_grads(self, callback: Callable[[torch.Tensor], None]) -> RemovableHandle:
        """`callback(param)` runs as each parameter's gradient is accumulated, until the handle is removed."""
        if not self.observe_grads:
            raise RuntimeError("watch_grads needs a Session built with observe_grads=True")
        handle = RemovableHandle(self._grad_watchers)
        self._grad_watchers[handle.id] = callback
        return handle

    def parameters(self) -> list[torch.Tensor]:
        return list(self.base_model.parameters())

    def batch_tensors(self) -> list[torch.Tensor]:
        return tensors_of((self.x, self.y))

    def optimizer_state(self) -> list[torch.Tensor]:
        optimizer = getattr(self.optimizer, "optim", self.optimizer)  # ZeroRedundancyOptimizer keeps its shard's here
        return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


# --- verification --------------------------------------------------------------------------------------

@dataclass
class Snapshot:
    """The result of one forward (and in training backward and one optimizer step) from the seeded start."""

    loss: float
    outputs: list[torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    stepped: dict[str, torch.Tensor] = field(default_factory=dict)  # the weights after the optimizer step


def snapshot(case: Case, strategy: Strategy) -> Snapshot:
    """Forward, loss and (in training) backward and one optimizer step from a fresh session.

    Gradients are brought to true scale; a gradient that a strategy frees as soon as it exists (a step taken in
    backward) is the one seen when it was accumulated. Outputs of micro-batches are joined along the batch.
    """
    accumulated: dict[int, torch.Tensor] = {}  # by id: a parameter as a key would make a cycle through its hook

    def keep_grad(param: torch.Tensor) -> None:
        accumulated[id(param)] = param.grad.detach().float().cpu().clone()

    session = Session(case, strategy, observe_grads=True)
    session.watch_grads(keep_grad)
    grads: dict[str, torch.Tensor | None] = {}
    stepped: dict[str, torch.Tensor] = {}
    with strategy.session():
        if case.phase == "train":
            parts: list[list[torch.Tensor]] = []
            losses: list[float] = []

            def seen(output: Any, micro_loss: torch.Tensor) -> None:
                parts.append(tensors_of(_detached(output)))
                losses.append(float(micro_loss.detach()))

            session.forward_backward(seen=seen)
            loss = sum(losses)
            outputs = [torch.cat(pieces) if len(pieces) > 1 else pieces[0] for pieces in zip(*parts)]
            strategy.unscale_grads(session.optimizer)
            grads = {name: accumulated.get(id(p)) if p.grad is None else whole(p.grad).detach().float().cpu().clone()
                     for name, p in session.base_model.named_parameters()}
            strategy.optimizer_step(session.optimizer)
            stepped = {name: whole(p).detach().float().cpu().clone()
                       for name, p in session.base_model.named_parameters()}
        else:
            inputs, _ = session.batch()
            output = session.forward(inputs)
            loss = float(session.loss(output).detach())
            outputs = tensors_of(_detached(output))
    buffers = {name: b.detach().cpu().clone() for name, b in session.base_model.named_buffers()}
    outputs = [t.float() for t in outputs if t.is_floating_point()]
    return Snapshot(strategy.reduce_loss(loss), outputs, grads, buffers, stepped)


def _detached(output: Any) -> Any:
    return tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, output)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a sharded one (a DTensor gathered from every rank: every rank must call this)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


@functools.lru_cache(maxsize=16)
def baseline_snapshot(case: Case) -> Snapshot:
    """The baseline's snapshot for the case's workload, phase, batch, device and data."""
    case = replace(case, strategy="baseline", warmup=0, steps=0)
    return snapshot(case, bind_case(case)[0])


clear_on_fake_mode_change(_cpu_batch.cache_clear)
clear_on_fake_mode_change(baseline_snapshot.cache_clear)


def compare(result: Snapshot, reference: Snapshot, strategy: Strategy) -> dict[str, Any]:
    """Loss, gradients and BatchNorm statistics against the baseline, and whether all are within tolerance."""
    tol = strategy.tolerance
    loss_rel_diff = abs(result.loss - reference.loss) / max(abs(reference.loss), 1e-12)
    max_abs, max_rel, missing = 0.0, 0.0, 0
    for name, ref in reference.grads.items():
        got = result.grads.get(name)
        if ref is None:
            continue
        if got is None:
            missing += 1
            continue
        diff = (got - ref).abs()
        max_abs = max(max_abs, float(diff.max()))
        max_rel = max(max_rel, float((got - ref).norm() / ref.norm().clamp_min(1e-12)))
    bn_match = True
    for name, ref in reference.buffers.items():
        got = result.buffers[name]
        if ref.dtype in (torch.int64, torch.int32):
            bn_match &= bool(torch.equal(got, ref))  # num_batches_tracked: a second update shows here
        else:
            bn_match &= bool(torch.allclose(got, ref, rtol=tol.grad_rtol, atol=tol.output_atol))
    output_rel_diff = _output_rel_diff(result.outputs, reference.outputs, tol.output_atol)
    output_match = output_rel_diff <= tol.output_rtol
    param_rel = max((float((result.stepped[name] - ref).norm() / ref.norm().clamp_min(1e-12))
                     for name, ref in reference.stepped.items()), default=0.0)
    matches = (loss_rel_diff <= tol.loss_rtol and max_rel <= tol.grad_rtol and missing == 0 and bn_match
               and param_rel <= tol.step_rtol and (output_match or bool(reference.grads)))
    return {
        "matches_baseline": bool(matches),
        "loss_rel_diff": loss_rel_diff,
        "max_abs_grad_diff": max_abs if reference.grads else None,
        "max_grad_rel_diff": max_rel if reference.grads else None,
        "params_without_grad": missing,
        "bn_stats_match": bool(bn_match),
        "output_rel_diff": output_rel_diff,
        "max_param_rel_diff": param_rel if reference.stepped else None,
    }


def _output_rel_diff(outputs: list[torch.Tensor], references: list[torch.Tensor], atol: float) -> float:
    """The largest |out - ref| / |ref| (norms) over the output tensors; 0 for one within `atol` element by
    element; infinite when the outputs differ in number or shape."""
    if len(outputs) != len(references) or any(o.shape != r.shape for o, r in zip(outputs, references)):
        return float("inf")
    worst = 0.0
    for got, ref in zip(outputs, references):
        if not torch.allclose(got, ref, rtol=0, atol=atol):
            worst = max(worst, float((got - ref).norm() / ref.norm().clamp_min(1e-12)))
    return worst


def verify(case: Case, strategy: Strategy) -> dict[str, Any]:
    """The verification columns of the row, and in `message` why the strategy cannot match, if it cannot; on fake
    tensors (the fake-CUDA run) nothing is compared, since they have no values: `matches_baseline` is empty."""
    progress.report("verification", 0, 1)
    result = snapshot(case, strategy)
    values = (*result.outputs, *result.buffers.values(), *result.grads.values())
    if any(is_fake(t) for t in values if t is not None):
        return {"matches_baseline": None, "message": "not verified: the step ran on fake tensors, which have no values"}
    columns = compare(result, baseline_snapshot(case), strategy)
    reason = strategy.differs_by_design()
    if reason:
        columns["message"] = f"does not match the baseline by design: {reason}"
    return columns


# --- timing and memory ---------------------------------------------------------------------------------

def step_times(case: Case, strategy: Strategy) -> timing.TimingStats:
    """One repeat: a fresh session, warm-up steps, then steps timed one by one as `case.timing_policy()` says."""
    session = Session(case, strategy)
    with strategy.session():
        return timing.time_steps(session.step, case.timing_policy(), case.device)


def timing_pass(case: Case, strategy: Strategy, repeats: int = 1) -> dict[str, Any]:
    """`repeats` repeats of warm-up + timed steps, with nothing tracking memory; all steps pooled.

    Besides the timing columns (see bench.measure.stats for the confidence interval and the noise flag) and those that say
    how the steps were counted (`timing_columns`), the result holds `_step_times_ms`, the raw times of each repeat,
    so that repeats run elsewhere can be pooled."""
    started = time.perf_counter()
    per_repeat = [step_times(case, strategy) for _ in range(repeats)]
    times = [stats.times_ms for stats in per_repeat]
    return {**summarize_timing(case.batch_size, times),
            **timing_columns(case, per_repeat, time.perf_counter() - started), "_step_times_ms": times}


def timing_columns(case: Case, per_repeat: list[timing.TimingStats], seconds: float) -> dict[str, Any]:
    """The row's record of the timing options and of what they led to: steps measured (all repeats), why each
    repeat stopped (distinct reasons joined by `,`), the median's distribution-free interval width at the stop
    (the figure compared with the target; pooled steps) and the pass's wall time, warm-up included."""
    pooled = [t for stats in per_repeat for t in stats.times_ms]
    return {
        "measured_steps": len(pooled),
        "timing_fixed_steps": case.steps,
        "timing_min_steps": None if case.steps else case.min_steps,
        "timing_max_time_s": None if case.steps else case.max_time_s,
        "timing_target_ci_rel": None if case.steps else case.target_ci_rel,
        "timing_stop_reason": ",".join(dict.fromkeys(stats.stop_reason for stats in per_repeat)),
        "timing_ci_rel": timing.median_ci_rel_width(pooled),
        "timing_pass_s": seconds,
    }


def memory_pass(case: Case, strategy: Strategy, record_timeline: bool = False,
                tracker: memory.LiveTensorTracker | None = None,
                prepare: Callable[[Session, memory.LiveTensorTracker], None] | None = None,
                session_class: Callable[..., Session] = Session, warmup_steps: int | None = None,
                growth_steps: int | None = None) -> dict[str, Any]:
    """The peak of one steady-state step: CUDA's allocator statistics, or the exact live-tensor count on the CPU.

    On the CPU (or meta) the row also gets the breakdown of the peak (`bench.measure.breakdown.BREAKDOWN_COLUMNS`);
    `tracker` replaces the default exact tracker, `prepare(session, tracker)` runs just before the measured step;
    `session_class` builds the session (the fake-tensor engine's `FakeSession`; CPU and meta only); on CUDA a
    `tracker` counts live tensors instead of reading the allocator (predict's fake-CUDA engine, on fake tensors);
    `warmup_steps` replaces the device's `MEMORY_WARMUP_STEPS` (a prediction of CUDA runs CUDA's count elsewhere),
    `growth_steps` replaces `MEMORY_GROWTH_STEPS` (0: a caller that only wants the peak saves a step).
    After the measured step `MEMORY_GROWTH_STEPS` more run, outside the peak, for `mem_growth_bytes_per_step`.
    """
    warmup = MEMORY_WARMUP_STEPS.get(case.device, 1) if warmup_steps is None else warmup_steps
    growth = MEMORY_GROWTH_STEPS if growth_steps is None else growth_steps
    if case.device == "cuda" and tracker is None:
        release_cuda_memory()
        session = Session(case, strategy)
        with strategy.session():
            ends = []
            for _ in range(warmup):
                session.step()
                ends.append(torch.cuda.memory_allocated())
            peak = memory.cuda_peak(session.step)
            ends.append(torch.cuda.memory_allocated())
            ends += _growth_steps(session.step, torch.cuda.memory_allocated, growth)
        return {"peak_mem_bytes": peak.allocated_bytes, "peak_reserved_bytes": peak.reserved_bytes,
                "memory_method": "cuda_max_memory_allocated", "peak_stage": None,
                "mem_growth_bytes_per_step": growth_per_step(ends)}
    if case.device == "cpu" and strategy.cpu_memory_count == "allocator_events" and tracker is None:
        return allocator_memory_pass(case, strategy)
    tracker = tracker or memory.LiveTensorTracker(case.device, record_timeline=record_timeline)
    session = session_class(case, strategy, observe_grads=True)
    with strategy.session(), tracker:
        tracker.track(session.parameters(), "params")
        tracker.track(session.base_model.buffers(), "buffers")
        tracker.track(session.batch_tensors(), "batch")

        def mark(stage: str) -> None:
            tracker.stage = stage

        progress.report("memory", 0, 1)
        ends = []
        for _ in range(warmup):
            session.step(mark)
            ends.append(tracker.live_bytes)
        handles = breakdown.prepare_breakdown(session, tracker)
        if prepare is not None:
            prepare(session, tracker)
        tracker.stage = "setup"
        tracker.reset_peak()
        session.step(mark)
        for handle in handles:
            handle.remove()
        ends.append(tracker.live_bytes)
        result = {"peak_mem_bytes": tracker.peak_bytes, "peak_reserved_bytes": None,
                  "memory_method": f"{tracker.device}_live_tensor_bytes", "peak_stage": tracker.peak_stage,
                  **breakdown.breakdown_columns(tracker)}
        timeline, tracker.record_timeline = tracker.timeline, False
        ends += _growth_steps(lambda: session.step(mark), lambda: tracker.live_bytes, growth)
    tracker.timeline = timeline
    return {**result, "mem_growth_bytes_per_step": growth_per_step(ends), "_tracker": tracker}


def allocator_memory_pass(case: Case, strategy: Strategy) -> dict[str, Any]:
    """The peak of one steady-state CPU step counted at the allocator (`memory.AllocatorEventCounter`), for a
    strategy whose step the exact tracker would change (`cpu_memory_count`); no breakdown by category."""
    session = Session(case, strategy)
    with strategy.session():
        for _ in range(MEMORY_WARMUP_STEPS.get(case.device, 1)):
            session.step()
        progress.report("memory", 0, 1)
        peak = memory.AllocatorEventCounter().peak(session.step, lambda: live_tensor_bytes(session))
        ends = [live_tensor_bytes(session)]
        for _ in range(MEMORY_GROWTH_STEPS + 1):
            session.step()
            ends.append(live_tensor_bytes(session))
    return {"peak_mem_bytes": peak.peak_bytes, "peak_reserved_bytes": None,
            "memory_method": "cpu_allocator_events", "peak_stage": peak.peak_stage,
            "mem_growth_bytes_per_step": growth_per_step(ends)}


def live_tensor_bytes(session: Session) -> int:
    """Bytes of the storages a session holds between steps: parameters and their gradients, buffers, the batch,
    the optimizer's state and what the loop keeps (the last output and loss)."""
    counter = memory.LiveTensorTracker(session.case.device)
    grads = [p.grad for p in session.parameters()]
    for category, tensors in (("params", session.parameters()), ("grads", grads),
                              ("buffers", session.base_model.buffers()), ("batch", session.batch_tensors()),
                              ("optimizer", session.optimizer_state()), ("kept", tensors_of(session.kept))):
        counter.track(tensors, category)
    return counter.live_bytes


# Steps run after the measured one, so that growth is seen over several steps (not only across the measured one).
MEMORY_GROWTH_STEPS = 1


def _growth_steps(step: Callable[[], None], live_bytes: Callable[[], int],
                  count: int = MEMORY_GROWTH_STEPS) -> list[int]:
    ends = []
    for _ in range(count):
        step()
        ends.append(live_bytes())
    return ends


def growth_per_step(ends: list[int]) -> float:
    """The mean growth of live bytes per step, from the live bytes at the end of consecutive steps."""
    return (ends[-1] - ends[0]) / (len(ends) - 1)


class CaseMeter(PlanMeter):
    """The runner's side of `Strategy.plan()`: peaks and FLOPs of the case, for a strategy choosing its settings."""

    def __init__(self, case: Case):
        self.case = case
        self._baseline: int | None = None

    def predicted_peak(self, strategy: Strategy) -> int:
        """On the meta device with the exact tracker (no arithmetic: seconds at any batch); on the CPU where meta
        cannot run the strategy."""
        try:
            measured = memory_pass(replace(self.case, device="meta"), strategy,
                                 tracker=memory.LiveTensorTracker("meta"))
        except Exception as error:  # noqa: BLE001 - a strategy meta cannot run is tracked on the CPU
            forget_traceback(error)
            measured = memory_pass(replace(self.case, device="cpu"), strategy)
        return int(measured["peak_mem_bytes"])

    def measured_peak(self, strategy: Strategy) -> int:
        return int(memory_pass(self.case, strategy)["peak_mem_bytes"])

    def baseline_peak(self) -> int:
        if self._baseline is None:
            baseline = replace(self.case, strategy="baseline")
            self._baseline = self.measured_peak(bind_case(baseline)[0])
        return self._baseline

    def unit_flops(self) -> list[int]:
        """One training-mode forward of the baseline on the meta device under FlopCounterMode, split at the
        checkpoint units by forward hooks (FLOPs of matmuls, convolutions and attention; element-wise work counts 0)."""
        from torch.utils.flop_counter import FlopCounterMode

        case = replace(self.case, strategy="baseline", device="meta")
        session = Session(case, bind_case(case)[0])
        units = session.workload.checkpoint_units(session.base_model)
        flops = [0] * len(units)
        counter = FlopCounterMode(display=False)
        handles = []
        for index, unit in enumerate(units):
            def before(module, args, index=index):
                flops[index] -= counter.get_total_flops()

            def after(module, args, output, index=index):
                flops[index] += counter.get_total_flops()
            handles += [unit.register_forward_pre_hook(before), unit.register_forward_hook(after)]
        with counter:
            session.forward()
        for handle in handles:
            handle.remove()
        return flops


def release_cuda_memory() -> None:
    """Frees what earlier cases left in the caching allocator, so one case's pool does not feed the next."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def forget_traceback(error: BaseException) -> None:
    """Drops the traceback (and its frames' tensors) of `error` and of the errors chained to it, then frees memory."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.__traceback__ = None
        error = error.__cause__ or error.__context__
    release_cuda_memory()


def rule_of_thumb_bytes(case: Case) -> int:
    """The article's estimate for the case (see `bench.run.rule_of_thumb`)."""
    return rule_of_thumb(case.workload, case.phase, case.batch_size)["total_bytes"]


# What the allocators say when memory runs out: CUDA raises torch.OutOfMemoryError ("CUDA out of memory"), the
# CPU allocator a plain RuntimeError ("DefaultCPUAllocator: can't allocate memory: you tried to allocate ...").
OOM_MESSAGES = ("out of memory", "can't allocate memory", "cannot allocate memory")


def is_oom(error: BaseException) -> bool:
    """Whether `error` is an allocation failure (on CUDA or the CPU): such a case is an `oom` row."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(error).lower()
    return any(message in text for message in OOM_MESSAGES)


def base_row(case: Case, env: dict | None = None, options: RunOptions | None = None) -> dict[str, Any]:
    """The columns a row has before anything is measured: the case, the run options, the environment."""
    options = options or RunOptions()
    return {
        "schema_version": SCHEMA_VERSION, "timestamp": now_iso(), "workload": case.workload,
        "strategy": case.strategy, "phase": case.phase, "device": case.device, "batch_size": case.batch_size,
        "data": case.data, "warmup_steps": case.warmup, "measured_steps": case.steps,
        "timing_fixed_steps": case.steps, "timing_min_steps": None if case.steps else case.min_steps,
        "timing_max_time_s": None if case.steps else case.max_time_s,
        "timing_target_ci_rel": None if case.steps else case.target_ci_rel,
        "status": "ok", "message": "",
        **(env or environment(case.device)),
        "isolated": bool(options.isolate), "repeats": options.repeats, "deterministic": bool(options.deterministic),
        "executor": options.executor, "ranks": 1,
    }


def settings_text(strategy: Strategy) -> str:
    """The row's `strategy_settings`: `name.option=value;...`."""
    return ";".join(f"{k}={v}" for k, v in strategy.describe().items())


def autocast_dtype(strategy: Strategy) -> str | None:
    """The 16-bit float type the strategy autocasts to (its `*.dtype` setting, e.g. `amp.dtype=bfloat16`), or None."""
    for key, value in strategy.describe().items():
        if key.endswith(".dtype") and value in ("bfloat16", "float16"):
            return str(value)
    return None


def workload_columns(workload) -> dict[str, str]:
    """`workload` (the canonical spec) and `workload_settings` (every option, `name=value;...`) of a row."""
    return {"workload": workload.spec(),
            "workload_settings": ";".join(f"{k}={v}" for k, v in workload.describe().items())}


def run_case(case: Case, env: dict | None = None, options: RunOptions | None = None,
             verify_result: bool = True) -> dict[str, Any]:
    """One row: the case, its verification, timing and memory, and its status (ok, oom, unsupported, error).

    In this process, inside `process_state` (threads and determinism set, every process-wide flag restored
    afterwards). With `options.repeats` K > 1 the timing pass and the memory pass run K times each:
    `peak_mem_bytes` is the largest peak and `peak_mem_spread_bytes` the largest minus the smallest (0 on the
    CPU, where the count is exact). `verify_result=False` skips the comparison with the baseline (later repeats of
    an isolated case). `_step_times_ms` and `_peaks` hold the raw figures; run_cases drops them.
    """
    options = options or RunOptions()
    row = base_row(case, env, options)
    with process_state(options.threads, options.deterministic):
        row["cpu_threads"] = torch.get_num_threads()
        try:
            strategy, context = bind_case(case, options.ranks)
            row.update(workload_columns(context.workload))
            row["strategy"] = strategy.spec()
            strategy.check(context)
            row["strategy_settings"] = settings_text(strategy)
            row["emulated_16bit"] = emulated_on_cpu(autocast_dtype(strategy), case.device)
            if strategy.distributed and not in_rank_process():
                row.update(run_on_ranks(case, env, options, verify_result))
                return row
            strategy.plan(CaseMeter(case))
            if verify_result:
                row.update(verify(case, strategy))
            row.update(timing_pass(case, strategy, options.repeats))
            peaks = []
            for index in range(options.repeats):
                measured = memory_pass(case, strategy, record_timeline=index == 0 and case.phase == "train")
                tracker = measured.pop("_tracker", None)
                if tracker is not None and tracker.timeline:
                    row["_timeline"] = [asdict(point) for point in tracker.timeline]
                peaks.append(measured["peak_mem_bytes"])
            row.update(measured, **peak_columns(peaks))
            row.update(strategy.columns())
            row["rule_of_thumb_bytes"] = rule_of_thumb_bytes(case)
            row["strategy_settings"] = settings_text(strategy)  # with what the model resolved (segments=auto)
        except (Unsupported, UsageError) as error:
            # a value the pre-run checks (bench.run.preflight) let through that this one case cannot take: its row
            # says so and the sweep goes on with the unrelated cases after it
            row.update(status="unsupported", message=str(error))
        except Exception as error:  # noqa: BLE001 - any failure becomes a row and the sweep goes on
            row.update(status="oom" if is_oom(error) else "error",
                       message=f"{type(error).__name__}: {error}".splitlines()[0][:500])
            forget_traceback(error)
        finally:
            if case.device == "cuda":
                release_cuda_memory()
    return row


def peak_columns(peaks: list[int]) -> dict[str, Any]:
    """`peak_mem_bytes` (the largest of the repeats) and `peak_mem_spread_bytes` (largest minus smallest)."""
    return {"peak_mem_bytes": max(peaks), "peak_mem_spread_bytes": max(peaks) - min(peaks), "_peaks": peaks}


def run_case_isolated(case: Case, env: dict | None, options: RunOptions) -> dict[str, Any]:
    """`run_case` with each of the K repeats in a fresh worker process; the repeats' figures pooled.

    The first repeat also verifies against the baseline. A repeat that does not end `ok` (a crashed worker
    included) ends the case, and its row is the case's row.
    """
    repeats = []
    for index in range(options.repeats):
        row = {**base_row(case, env, options), **run_in_worker(case, env, options, verify=index == 0)}
        if row["status"] != "ok":
            return pool_repeats(case, [row], options)
        repeats.append(row)
    return pool_repeats(case, repeats, options)


def pool_repeats(case: Case, repeats: list[dict[str, Any]], options: RunOptions) -> dict[str, Any]:
    """The row of a case whose repeats ran in separate processes: the first repeat's row (it verified), with
    the timing and peaks of all repeats pooled; a repeat that did not end `ok` is the case's row."""
    failed = [r for r in repeats if r["status"] != "ok"]
    row = dict(failed[0] if failed else repeats[0])
    row.update(isolated=True, repeats=options.repeats)
    if failed:
        return row
    times = [t for r in repeats for t in r["_step_times_ms"]]
    peaks = [p for r in repeats for p in r["_peaks"]]
    row.update(summarize_timing(case.batch_size, times), **peak_columns(peaks))
    reasons = ",".join(r["timing_stop_reason"] for r in repeats).split(",")
    row.update(measured_steps=sum(len(t) for t in times), timing_stop_reason=",".join(dict.fromkeys(reasons)),
               timing_ci_rel=timing.median_ci_rel_width([t for repeat in times for t in repeat]),
               timing_pass_s=sum(r["timing_pass_s"] for r in repeats))
    return row


# An executor runs cases and yields (index in `cases`, case, row) as each case finishes, in any order; it calls
# `started(index, case)` when a case begins, if it knows. bench.run.ray_executor is another.
Executor = Callable[[list[Case], RunOptions, Callable[[int, Case], None]], Iterator[tuple[int, Case, dict]]]


def local_executor(cases: list[Case], options: RunOptions,
                   started: Callable[[int, Case], None]) -> Iterator[tuple[int, Case, dict]]:
    """Cases one after the other on this machine: in this process, or each in fresh worker processes."""
    envs: dict[str, dict] = {}
    for index, case in enumerate(cases):
        started(index, case)
        env = envs.setdefault(case.device, environment(case.device))
        if options.isolate:
            yield index, case, run_case_isolated(case, env, options)
        else:
            yield index, case, run_case(case, env, options)


class StepTimeline:
    """Live bytes after each operator of one training step per case, kept in `<run>.timeline.csv` beside the results.

    The chart of memory over a step is drawn from this file. A resumed run keeps the points already on disk.
    """

    COLUMNS = ["workload", "strategy", "phase", "device", "batch_size", "data", "index", "stage", "op", "live_bytes"]

    def __init__(self, results_path: Path | None):
        self.path = None if results_path is None else Path(results_path).with_suffix(".timeline.csv")
        self.frames: list[pd.DataFrame] = []
        if self.path is not None and self.path.exists():
            self.frames.append(pd.read_csv(self.path))
        self.changed = False

    def add(self, case: Case, points: list[dict] | None) -> None:
        if not points:
            return
        frame = pd.DataFrame(points)
        for key in ("workload", "strategy", "phase", "device", "batch_size", "data"):
            frame[key] = getattr(case, key)
        self.frames.append(frame[self.COLUMNS])
        self.changed = True

    def write(self) -> None:
        if self.path is not None and self.changed:
            write_csv_atomic(pd.concat(self.frames, ignore_index=True), self.path)
            self.changed = False


def run_cases(cases: list[Case], out_path: Path | None = None,
              progress: Callable[[int, int, Case, dict | None], None] | None = None,
              options: RunOptions | None = None, previous_rows: list[dict] | None = None,
              run_id: str | None = None, executor: Executor = local_executor) -> list[dict]:
    """Runs every case; after each one finishes the CSV at `out_path` is rewritten atomically with all rows so far.

    `options`: isolation, repeats, threads, determinism (bench.run.isolation.RunOptions; default: in-process, once).
    `executor` runs the cases (default: here, in order; `bench.run.ray_executor.RayExecutor` on a Ray cluster); rows
    are written in the cases' order whatever order they finish in. `previous_rows` (a resumed run's finished
    rows) are written first and returned with the new ones; `run_id` defaults to the file's stem. A reader (or a
    run killed at any moment) never sees a half-written file: each write goes to a temporary file renamed over
    the CSV.
    """
    options = (options or RunOptions()).resolved()
    run_id = run_id or (new_run_id() if out_path is None else Path(out_path).stem)
    finished: dict[int, dict] = {}
    timeline = StepTimeline(out_path)

    def started(index: int, case: Case) -> None:
        if progress:
            progress(index, len(cases), case, None)

    for index, case, row in executor(cases, options, started):
        timeline.add(replace(case, strategy=row["strategy"]), row.get("_timeline"))
        row = {k: v for k, v in row.items() if not k.startswith("_")}
        row["run_id"] = run_id
        row["timestamp"] = now_iso()  # when the case finished, as results/README.md says
        finished[index] = row
        if out_path is not None:
            write_rows(list(previous_rows or []) + [finished[i] for i in sorted(finished)], out_path)
            timeline.write()
        if progress:
            progress(index, len(cases), case, row)
    return list(previous_rows or []) + [finished[i] for i in sorted(finished)]
