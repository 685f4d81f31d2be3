"""The measuring passes of a case: timing (nothing tracked) and memory (CUDA's allocator, or the exact live-tensor
count on the CPU), each from a fresh session; and the meter a strategy's `plan()` measures the case with.

A pass returns its row columns (read like a dict) with what it measured besides them as typed attributes: the
timing pass each repeat's step times, the memory pass its tracker (and through it the step timeline).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import time
from dataclasses import replace
from typing import Any, Callable, Iterator, Mapping

import torch
from torch._subclasses.fake_tensor import is_fake

from bench.core import progress
from bench.measure.op_cost import FlopCounterMode  # imported quietly there
from bench.measure.cuda_peak import cuda_peak
from bench.measure import allocator_events, breakdown, call_replay, memory, snapshot, timing
from bench.measure.stats import summarize_timing
from bench.run.case import Case, bind_case
from bench.run.session import Session
from bench.run.training_state import training_state_bytes
from bench.run.verify import non_finite_loss
from strategies import PlanMeter, Strategy
from workloads import tensors_of

# Steps before the measured one: one makes Adam's state and the previous step's output and loss exist; CUDA
# gets a second so that cuDNN's autotuning and the allocator's first-step behaviour are behind it.
MEMORY_WARMUP_STEPS = {"cpu": 1, "cuda": 2}
# Steps run after the measured one, so that growth is seen over several steps (not only across the measured one).
MEMORY_GROWTH_STEPS = 1


class PassResult(Mapping[str, Any]):
    """The row columns a pass measured, read like a dict (`result["peak_mem_bytes"]`)."""

    def __init__(self, columns: dict[str, Any]):
        self.columns = dict(columns)

    def __getitem__(self, column: str) -> Any:
        return self.columns[column]

    def __iter__(self) -> Iterator[str]:
        return iter(self.columns)

    def __len__(self) -> int:
        return len(self.columns)


class TimingResult(PassResult):
    """The timing pass's columns, and `step_times_ms`: each repeat's timed steps (to pool repeats run elsewhere)."""

    def __init__(self, columns: dict[str, Any], step_times_ms: list[list[float]]):
        super().__init__(columns)
        self.step_times_ms = step_times_ms


class MemoryResult(PassResult):
    """The memory pass's columns, and the live-tensor tracker that counted them (None where CUDA's allocator or
    the CPU allocator's events did); its `timeline` holds the measured step's points when one was recorded, its
    `events` every allocation and free when the pass recorded a snapshot; `cuda_snapshot` is the one CUDA recorded."""

    def __init__(self, columns: dict[str, Any], tracker: memory.LiveTensorTracker | None = None,
                 cuda_snapshot: dict[str, Any] | None = None):
        super().__init__(columns)
        self.tracker = tracker
        self.cuda_snapshot = cuda_snapshot


def step_times(case: Case, strategy: Strategy) -> timing.TimingStats:
    """One repeat: a fresh session, warm-up steps, then steps timed one by one as `case.timing_policy()` says.

    A training loss that has become NaN or infinite by the last step raises NonFiniteLoss (checked once, after
    the timed steps: a diverging run, which the verification's single step from the seeded start cannot see)."""
    session = Session(case, strategy)
    with strategy.session():
        stats = timing.time_steps(session.step, case.timing_policy(), case.device)
    loss = session.kept.get("loss")
    if isinstance(loss, torch.Tensor) and not is_fake(loss) and loss.numel() == 1:
        value = float(loss.detach())
        if not math.isfinite(value):
            steps = case.timing_policy().warmup + len(stats.times_ms)
            raise non_finite_loss(value, f"at step {steps} (the last of the timing pass)")
    return stats


def timing_pass(case: Case, strategy: Strategy, repeats: int = 1) -> TimingResult:
    """`repeats` repeats of warm-up + timed steps, with nothing tracking memory; all steps pooled.

    Besides the timing columns (see bench.measure.stats for the confidence interval and the noise flag) and those
    that say how the steps were counted (`timing_columns`), the result holds `step_times_ms`, the raw times of each
    repeat, so that repeats run elsewhere can be pooled."""
    started = time.perf_counter()
    per_repeat = [step_times(case, strategy) for _ in range(repeats)]
    times = [stats.times_ms for stats in per_repeat]
    columns = {**summarize_timing(case.batch_size, times),
               **timing_columns(case, per_repeat, time.perf_counter() - started)}
    return TimingResult(columns, times)


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
                growth_steps: int | None = None, record_snapshot: bool = False, steady_warmup: bool = False,
                repeat_warmup: bool = False) -> MemoryResult:
    """The peak of one steady-state step: CUDA's allocator statistics, or the exact live-tensor count on the CPU.

    On the CPU (or meta) the row also gets the breakdown of the peak (`bench.measure.breakdown.BREAKDOWN_COLUMNS`);
    `tracker` replaces the default exact tracker, `prepare(session, tracker)` runs just before the measured step;
    `session_class` builds the session (the fake-tensor engine's `FakeSession`; CPU and meta only); on CUDA a
    `tracker` counts live tensors instead of reading the allocator (predict's fake-CUDA engine, on fake tensors);
    `warmup_steps` replaces the device's `MEMORY_WARMUP_STEPS` (a prediction of CUDA runs CUDA's count elsewhere),
    `growth_steps` replaces `MEMORY_GROWTH_STEPS` (0: a caller that only wants the peak saves a step).
    After the measured step `MEMORY_GROWTH_STEPS` more run, outside the peak, for `mem_growth_bytes_per_step`.
    `record_snapshot`: the tracker logs the step's allocations with their modules (`bench.measure.snapshot`), or on
    CUDA the allocator records its history (the result's `cuda_snapshot`).
    With a `tracker` that records events and two warm-up steps or more: `steady_warmup` prepares the breakdown (and
    runs `prepare`) before the last warm-up step as well, so that its log is the measured step's (the categories the
    measured step files its storages under, from the same point); `repeat_warmup` (which implies it) does not run the
    measured step but builds its log from the last warm-up step's (`bench.measure.step_repeat`), its peak counted
    event by event over that log. Neither moves the measured window's figures of a steady step (a test).
    """
    warmup = MEMORY_WARMUP_STEPS.get(case.device, 1) if warmup_steps is None else warmup_steps
    growth = MEMORY_GROWTH_STEPS if growth_steps is None else growth_steps
    if case.device == "cuda" and tracker is None:
        return _cuda_memory_pass(case, strategy, warmup, growth, record_snapshot)
    if case.device == "cpu" and strategy.cpu_memory_count == "allocator_events" and tracker is None:
        return allocator_memory_pass(case, strategy)
    tracker = tracker or memory.LiveTensorTracker(case.device, record_timeline=record_timeline,
                                                  record_events=record_snapshot)
    if (steady_warmup or repeat_warmup) and not (tracker.record_events and warmup >= 2):
        raise ValueError("a steady or repeated warm-up step needs a tracker that records events and two warm-up steps")
    return _tracked_memory_pass(session_class(case, strategy, observe_grads=True), tracker, prepare, warmup, growth,
                                steady_warmup or repeat_warmup, repeat_warmup)


def _cuda_memory_pass(case: Case, strategy: Strategy, warmup: int, growth: int,
                      record_snapshot: bool = False) -> MemoryResult:
    """The peak of one steady-state CUDA step from the caching allocator's statistics (and, with `record_snapshot`,
    the allocator's own history of that step)."""
    release_cuda_memory()
    session = Session(case, strategy)
    with strategy.session():
        ends = []
        for _ in range(warmup):
            session.step()
            ends.append(torch.cuda.memory_allocated())
        collect_warmup_garbage()
        with snapshot.cuda_history({}) if record_snapshot else contextlib.nullcontext({}) as recorded:
            peak = cuda_peak(session.step)
        ends.append(torch.cuda.memory_allocated())
        ends += _growth_steps(session.step, torch.cuda.memory_allocated, growth)
    return MemoryResult({"peak_mem_bytes": peak.allocated_bytes, "peak_reserved_bytes": peak.reserved_bytes,
                         "memory_method": "cuda_max_memory_allocated", "peak_stage": None,
                         "mem_growth_bytes_per_step": growth_per_step(ends)}, cuda_snapshot=recorded or None)


def _tracked_memory_pass(session: Session, tracker: memory.LiveTensorTracker,
                         prepare: Callable[[Session, memory.LiveTensorTracker], None] | None, warmup: int,
                         growth: int, steady_warmup: bool = False, repeat_warmup: bool = False) -> MemoryResult:
    """The peak of one steady-state step of `session` counted by `tracker`, with its breakdown by category; the
    tracker's timeline (when it records one) is the measured step's. `steady_warmup`, `repeat_warmup`: as
    `memory_pass`'s."""
    strategy = session.strategy
    replayed = call_replay.replayed_methods(strategy.replayable_calls())
    with strategy.session(), replayed, tracker, snapshot.ModuleScope(session.base_model, tracker):
        tracker.track(session.parameters(), "params")
        tracker.track(session.base_model.buffers(), "buffers")
        tracker.track(session.batch_tensors(), "batch")

        def mark(stage: str) -> None:
            tracker.stage = stage

        def prepared() -> list:
            """What precedes a measured step (the breakdown's hooks, whose handles it returns, and `prepare`)."""
            handles = breakdown.prepare_breakdown(session, tracker)
            if prepare is not None:
                prepare(session, tracker)
            tracker.stage = "setup"
            collect_warmup_garbage()
            return handles

        progress.report("memory", 0, 1)
        ends, handles, last_warmup = [], [], (0, 0, "")
        for index in range(warmup):
            if steady_warmup and index == warmup - 1:
                handles = prepared()
            start = len(tracker.events)
            session.step(mark)
            last_warmup = (start, len(tracker.events), tracker.stage)
            ends.append(tracker.live_bytes)
        for handle in handles:
            handle.remove()
        handles = prepared()
        tracker.reset_peak()
        if repeat_warmup:
            tracker.log_repeated_step(*last_warmup)
        else:
            session.step(mark)
        for handle in handles:
            handle.remove()
        ends.append(tracker.live_bytes)
        result = {"peak_mem_bytes": tracker.peak_bytes, "peak_reserved_bytes": None,
                  "memory_method": f"{tracker.device}_live_tensor_bytes", "peak_stage": tracker.peak_stage,
                  **breakdown.breakdown_columns(tracker)}
        timeline = tracker.timeline
        tracker.close_window()
        ends += _growth_steps(lambda: session.step(mark), lambda: tracker.live_bytes, growth)
    tracker.timeline = timeline
    return MemoryResult({**result, "mem_growth_bytes_per_step": growth_per_step(ends)}, tracker)


def allocator_memory_pass(case: Case, strategy: Strategy) -> MemoryResult:
    """The peak of one steady-state CPU step counted at the allocator (`allocator_events.AllocatorEventCounter`), for a
    strategy whose step the exact tracker would change (`cpu_memory_count`); no breakdown by category."""
    session = Session(case, strategy)
    with strategy.session():
        for _ in range(MEMORY_WARMUP_STEPS.get(case.device, 1)):
            session.step()
        progress.report("memory", 0, 1)
        collect_warmup_garbage()
        peak = allocator_events.AllocatorEventCounter().peak(session.step, lambda: live_tensor_bytes(session))
        ends = [live_tensor_bytes(session)]
        for _ in range(MEMORY_GROWTH_STEPS + 1):
            session.step()
            ends.append(live_tensor_bytes(session))
    return MemoryResult({"peak_mem_bytes": peak.peak_bytes, "peak_reserved_bytes": None,
                         "memory_method": "cpu_allocator_events", "peak_stage": peak.peak_stage,
                         "mem_growth_bytes_per_step": growth_per_step(ends)})


def collect_warmup_garbage() -> None:
    """Frees the warm-up's reference cycles before the measured step, as a long run's collector would have freed
    them by then: torch.compile's tracing leaves cycles that hold the tensors it traced (the warm-up step's inputs),
    and whether Python's collector ran before the peak decided whether they counted in it (4 KiB of a Llama's
    position ids, depending on what else the process had run). The measured step's own cycles are left to the
    collector, as in the user's run."""
    gc.collect()


def live_tensor_bytes(session: Session) -> int:
    """Bytes of the storages a session holds between steps: parameters and their gradients, buffers, the batch,
    the optimizer's state and the loop's variables (the last output and loss)."""
    counter = memory.LiveTensorTracker(session.case.device)
    grads = [p.grad for p in session.parameters()]
    for category, tensors in (("params", session.parameters()), ("grads", grads),
                              ("buffers", session.base_model.buffers()), ("batch", session.batch_tensors()),
                              ("optimizer", session.optimizer_state()), ("kept", tensors_of(session.kept))):
        counter.track(tensors, category)
    return counter.live_bytes



def _growth_steps(step: Callable[[], None], live_bytes: Callable[[], int],
                  count: int = MEMORY_GROWTH_STEPS) -> list[int]:
    ends = []
    for _ in range(count):
        step()
        ends.append(live_bytes())
    return ends


def growth_per_step(ends: list[int]) -> float | None:
    """The mean growth of live bytes per step, from the live bytes at the end of consecutive steps; None from one
    step (a pass with neither warm-up nor growth steps: fit's check of a first step)."""
    return (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else None


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

    def state_floor(self, strategy: Strategy) -> int | None:
        """The workload's parameters and optimizer state after one step, counted on the meta device (once), where
        `strategy` keeps them (`bench.run.training_state`)."""
        return self._training_state_bytes if strategy.keeps_training_state else None

    @functools.cached_property
    def _training_state_bytes(self) -> int | None:
        return training_state_bytes(self.case.workload)

    def unit_flops(self) -> list[int]:
        """One training-mode forward of the baseline on the meta device under FlopCounterMode, split at the
        checkpoint units by forward hooks (FLOPs of matmuls, convolutions and attention; element-wise work counts 0)."""
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
    """Frees what earlier cases left in the caching allocator, so one case's pool does not feed the next, and the
    cuBLAS workspaces, so that each case allocates its own as a fresh process would: cuBLAS keeps one per thread that
    ran a matrix product (32 MiB on compute capability 9.0) in the caching allocator, counted by
    max_memory_allocated, for the life of the process. Without this an eval case measured after a train case counted
    the backward thread's workspace, which the eval step never uses: 33.5 MiB over the prediction of captcha's
    no_grad_eval at batch 8 on an H200 (results/reference/gpu/), as PyTorch's own leak check clears them first."""
    gc.collect()
    if torch.cuda.is_available():
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            torch.cuda.synchronize()
            clear_workspaces()
        torch.cuda.empty_cache()


def forget_traceback(error: BaseException) -> None:
    """Drops the traceback (and its frames' tensors) of `error` and of the errors chained to it, then frees memory."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.__traceback__ = None
        error = error.__cause__ or error.__context__
    release_cuda_memory()
