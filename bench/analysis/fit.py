"""Fit: the largest batch whose peak stays under a memory budget, per strategy, confirmed by actual runs.

On the CPU the search runs on cheap estimates (fake-tensor probes, or a per-stage linear model) and confirms the
answer with tracked runs; on CUDA it tries real batches. `fit_rows` gives the rows of the declared fit table
(`bench.core.results.FIT`) that `python -m bench fit` writes; its console table is `bench.cli.analysis_console`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable

from bench.analysis import fake_engine, pools, predict
from bench.analysis.fit_search import (
    Probes, confirmed_batch, largest_on_stage_lines, largest_under, next_batch_peak, stage_line_estimate,
)
from bench.core.errors import Unsupported
from bench.core.results import FIT
from bench.core.schema import Row
from bench.core.units import format_mib
from bench.measure import timing
from bench.measure.cpu_16bit import emulated_dtype
from bench.run.case import Case, bind_case
from bench.run.runner import EMULATED_VERIFY_BATCH, Session, forget_traceback, is_oom, memory_pass, timing_pass


@dataclass
class FitResult:
    """The answer of fit for one strategy: its fields are the columns of the fit table (`bench.core.results.FIT`,
    documented in results/README.md), which `fit_rows` writes; a field the table does not declare is an error there."""

    strategy: str
    phase: str
    device: str
    budget_bytes: int
    batch_size: int  # 0: not even batch 1 fits
    peak_bytes: int | None
    verified: bool
    next_batch_peak_bytes: int | None  # the peak at batch_size + 1 (probe or measured), over budget
    next_batch_method: str
    time_per_sample_ms: float | None
    note: str
    runs: int  # actual tracked (or CUDA) runs made
    # the axis searched: batch (batch_size is the answer) or seq_len (`bench.analysis.fit_seq_len`: seq_len is the
    # answer at the given batch_size, on predictions; the next_* figures are then at seq_len + seq_len_step)
    over: str = "batch"
    seq_len: int | None = None
    seq_len_step: int | None = None
    judged_bytes: int | None = None  # what is compared with the budget: on CUDA reserved + the CUDA context
    next_judged_bytes: int | None = None
    peak_by: str = ""  # what makes up the peak: the largest category, the attention kernel, the recompute plan
    monotonic_check: str = ""  # where the search's assumption (the peak never falls as it grows) was checked
    config: str | None = None  # `fit --config`: the trainer configuration the strategy was derived from (bench.jobs)


def measured_peak(case, strategy) -> int:
    """An actual run: the exact tracked peak on the CPU, max_memory_allocated on CUDA (its warm-up steps and the
    measured one, no step after it)."""
    return int(memory_pass(case, strategy, growth_steps=0)["peak_mem_bytes"])


def _probe_peak(case, spec: str, warmup_steps: int | None = None) -> int | None:
    """The CPU peak counted on fake tensors (the same tracked step, no arithmetic: exact, see
    bench.measure.fake_cpu), of the steady-state step or with `warmup_steps=0` of the first; None where fake tensors
    cannot run the strategy."""
    try:
        step = fake_engine.tracked_step(case, spec, "fake", 1, cuda_autocast=False, warmup_steps=warmup_steps)
        return step.peak_bytes
    except Exception as error:  # noqa: BLE001 - a strategy that fake tensors cannot run: the per-stage model
        forget_traceback(error)
        return None


def stage_peaks(case, strategy) -> tuple[dict[str, int], int]:
    """One tracked step: the peak of live bytes within each stage (forward, backward, optimizer), and the peak."""
    memory = memory_pass(case, strategy, record_timeline=True)
    tracker = memory.tracker
    peaks: dict[str, int] = {}
    for point in tracker.timeline:
        peaks[point.stage] = max(peaks.get(point.stage, 0), point.live_bytes)
    return peaks, int(memory["peak_mem_bytes"])


def _quiet(text: str) -> None:
    pass


def peak_or_none_on_oom(case) -> int | None:
    """The measured peak of `case`, or None when it runs out of memory (any other error propagates)."""
    try:
        return measured_peak(case, bind_case(case)[0])
    except Exception as error:  # noqa: BLE001 - only an out-of-memory error is an answer here
        if not is_oom(error):
            raise
        forget_traceback(error)
        return None


# --- fit on the CPU: estimates, then tracked runs that confirm them ------------------------------------------

def first_step_peak(case) -> tuple[int | None, Session | None, object]:
    """A real tracked run of the case's first step (no warm-up): its peak (None: out of memory), and the session and
    strategy it ran, to time steps on afterwards."""
    strategy, sessions = bind_case(case)[0], []

    def keep(*args, **kwargs) -> Session:
        sessions.append(Session(*args, **kwargs))
        return sessions[-1]

    try:
        peak = int(memory_pass(case, strategy, warmup_steps=0, growth_steps=0, session_class=keep)["peak_mem_bytes"])
    except Exception as error:  # noqa: BLE001 - only an out-of-memory error is an answer here
        if not is_oom(error):
            raise
        sessions.clear()
        forget_traceback(error)
        return None, None, strategy
    return peak, sessions[0], strategy


@dataclass
class _TrackedRuns:
    """The actual tracked runs of one CPU fit: the peak per batch (infinite: out of memory) and how many ran.

    With an exact fake-tensor count (`steady`, the fake engine's steady-state peak at any batch) a batch is confirmed
    by one real tracked step, its first, equal to the fake count of the same first step to the byte: then the
    steady-state peak is the fake count's (the engine counts what the CPU holds between steps as exactly). A 16-bit
    strategy the CPU emulates (`emulated`) runs that check at batch min(b, EMULATED_VERIFY_BATCH), its arithmetic
    being slow. Where the two differ, or without fake counts, the batch is measured by a full tracked run (a
    warm-up step, then the measured one)."""
    spec: str
    budget: int
    case_at: Callable[[int], Case]
    progress: Callable[[str], None]
    steady: Callable[[int], int] | None = None
    emulated: bool = False
    peaks: dict[int, int | float] = field(default_factory=dict)
    checked_at: dict[int, int] = field(default_factory=dict)  # batch -> the batch its first step was checked at
    runs: int = 0
    last: tuple | None = None  # (batch, session, strategy) of the last real first step, for timing

    def peak(self, b: int) -> int | float:
        """The measured peak at batch `b`; infinite when the CPU allocator runs out of memory (over any budget)."""
        if b not in self.peaks:
            self.peaks[b] = self._measure(b)
            self.runs += 1
            self.progress(f"fit {self.spec}: batch {b}: " + ("out of memory" if self.peaks[b] == math.inf else
                                                             f"peak {format_mib(self.peaks[b])} MiB, "
                                                             f"budget {format_mib(self.budget)} MiB"))
        return self.peaks[b]

    def _measure(self, b: int) -> int | float:
        if self.steady is not None:
            check = min(b, EMULATED_VERIFY_BATCH) if self.emulated else b
            self.progress(f"fit {self.spec}: tracked run of a first step at batch {check} ...")
            self.last = None
            real, session, strategy = first_step_peak(self.case_at(check))
            if real is None:
                return math.inf
            if real == _probe_peak(self.case_at(check), self.spec, warmup_steps=0):
                self.checked_at[b] = check
                self.last = (check, session, strategy)
                return self.steady(b)
            self.progress(f"fit {self.spec}: its first step differs from the fake-tensor count; a full tracked run")
        self.progress(f"fit {self.spec}: tracked run at batch {b} ...")
        peak = peak_or_none_on_oom(self.case_at(b))
        return math.inf if peak is None else peak

    def time_per_sample(self, b: int, steps: int) -> float | None:
        """Milliseconds per sample, the median of `steps` steps at `b` with nothing tracking them: on the session of
        its tracked first step (so steady-state steps) where that ran at `b`, else from a fresh one."""
        last, self.last = self.last, None
        if last is None or last[0] != b:
            case = self.case_at(b)
            return time_per_sample(self.spec, case.phase, "cpu", case.workload, case.data, b, steps)
        _, session, strategy = last
        with strategy.session():
            stats = timing.time_steps(session.step, timing.TimingPolicy(warmup=0, steps=steps), "cpu")
        times = sorted(stats.times_ms)
        return times[len(times) // 2] / b


def _fake_probe_estimate(spec: str, case_at: Callable[[int], Case], low: int, high: int,
                         progress: Callable[[str], None], pool=None) -> Probes | None:
    """The peak at any batch from fake-tensor probes (each remembered, `Probes`: with a `pool`, made several at
    once), or None when fake tensors cannot run it. One job: the probe at `low` here, then each as the search asks
    (the serial search's probes); a pool: those at `low` and `high` at once."""
    def told(b: int, peak) -> None:
        if b != low:
            progress(f"fit {spec}: fake-tensor probe at batch {b}: " + (
                "fake tensors cannot run it" if peak is None else f"{format_mib(peak)} MiB"))

    # a probe whose worker died: over any budget, as an out-of-memory run is
    probes = Probes(_probe_peak, lambda b: (case_at(b), spec), pool, told, lambda b, error: math.inf)
    probes.prefetch([low] if pool is None else [low, high])
    return None if probes.values[low] is None else probes


def _stage_lines(case_at: Callable[[int], Case], low: int, high: int,
                 tracked: _TrackedRuns) -> dict[str, tuple[float, float]]:
    """Two tracked runs, at `low` and `high`: per stage, the (intercept, slope) of its peak against the batch."""
    (peaks_low, tracked.peaks[low]), (peaks_high, tracked.peaks[high]) = (
        stage_peaks(case_at(b), bind_case(case_at(b))[0]) for b in (low, high))
    tracked.runs += 2
    lines = {}
    for stage in peaks_low.keys() & peaks_high.keys():
        slope_s = (peaks_high[stage] - peaks_low[stage]) / (high - low)
        lines[stage] = (peaks_low[stage] - slope_s * low, slope_s)
    return lines


def fit_cpu(spec: str, budget: int, phase: str, workload: str, data: str, max_batch: int,
            low: int = 16, high: int = 32, progress: Callable[[str], None] = _quiet, time_steps: int = 1,
            pool=None) -> FitResult:
    """Largest batch with peak <= budget on the CPU, confirmed by actual tracked runs; with `time_steps`, the time
    per sample of that many steps at the answer (after its tracked first step, on the same session).

    With fake tensors (`bench.run.fake_pass`: the exact tracker without arithmetic, a second or so per probe at any
    batch, equal to a real step's count to the byte): `largest_under` on fake probes, then one real tracked first
    step at the answer, checked against the fake count of the same step (`_TrackedRuns`); a 16-bit strategy the CPU
    emulates is checked at a small batch and not timed. Where fake tensors cannot run the strategy: the peak within
    each stage of the step (forward, backward, optimizer) is linear in the batch size, so two tracked runs give one
    line per stage and the step's peak is the largest of them at any batch -- which a single slope from small
    batches is not (there the peak is Adam's step; at large ones it is the backward); then full tracked runs at
    the answer (a warm-up step and the measured one), stepping down while over the budget.

    With a `pool` of several jobs (`bench.analysis.pools`) the fake probes are made in rounds, several at once
    (`fit_search.largest_in_rounds`): the same answer where the peak grows with the batch; the tracked runs are made
    here, one after another, as without it.
    """
    def case_at(b: int, device: str = "cpu"):
        return Case(workload, spec, phase, b, device, data=data, warmup=0, steps=1)

    emulated = emulated_dtype(bind_case(case_at(1))[0], "cpu") is not None
    tracked = _TrackedRuns(spec, budget, case_at, progress, emulated=emulated)
    estimate = _fake_probe_estimate(spec, case_at, low, high, progress, pool)
    prefetch, jobs = None, 1
    if estimate is not None:
        tracked.steady = estimate
        prefetch, jobs = estimate.prefetch, estimate.jobs
        batch, method = largest_under(estimate, budget, low, high, max_batch, prefetch, jobs), "fake probe"
        slope = max((estimate(high) - estimate(low)) / (high - low), 1.0)
    else:
        lines = _stage_lines(case_at, low, high, tracked)
        estimate = stage_line_estimate(lines)
        slope = max(max(slope_s for _, slope_s in lines.values()), 1.0)
        batch, method = largest_on_stage_lines(lines, budget, max_batch), "per-stage linear model"
    batch = confirmed_batch(batch, tracked, estimate, method, slope, low, high, prefetch, jobs)
    if batch < 1 and method == "fake probe" and 1 not in tracked.peaks:
        # batch 1's fake count is over the budget and nothing was run: no real step of a model that may not fit
        # this machine (a full-size preset) to learn what the fake count says to the byte
        return FitResult(spec, phase, "cpu", budget, 0, None, False, estimate(1), "fake probe", None,
                         "even batch 1 exceeds the budget (its fake-tensor count; no real run)", tracked.runs)
    if batch < 1:  # the next batch's peak is batch 1's, measured: the smallest this strategy reaches
        return FitResult(spec, phase, "cpu", budget, 0, None, False, tracked.peak(1), "measured", None,
                         "even batch 1 exceeds the budget", tracked.runs)
    nxt, how, note = next_batch_peak(batch, tracked, estimate, method, max_batch)
    notes = [note] if note else []
    if batch in tracked.checked_at:
        notes.append(f"the peak is the fake-tensor count, which a real tracked first step at batch "
                     f"{tracked.checked_at[batch]} equalled to the byte")
    seconds = None
    if time_steps > 0 and emulated:
        notes.append("time not measured: 16-bit arithmetic emulated by this CPU")
    elif time_steps > 0:
        progress(f"fit {spec}: timing {time_steps} step(s) at batch {batch} ...")
        seconds = tracked.time_per_sample(batch, time_steps)
    else:
        notes.append("time not measured (--time-steps 0)")
    tracked.last = None
    return FitResult(spec, phase, "cpu", budget, batch, tracked.peak(batch), True, nxt, how, seconds,
                     "; ".join(notes), tracked.runs)


# --- fit on CUDA, and the fit of several strategies ------------------------------------------------------------

def fit_cuda(spec: str, budget: int, phase: str, workload: str, data: str, max_batch: int,
             progress: Callable[[str], None] = _quiet, capability: tuple[int, int] | None = None) -> FitResult:
    """Largest batch on CUDA by real attempts: doubling until the peak passes the budget or an OOM, then bisection.
    Without a GPU each attempt is `predict`'s allocated figure (on fake CUDA: the weights never exist), and the
    answer is not confirmed by a run."""
    gpu = fake_engine.has_gpu()
    runs = 0
    results: dict[int, int | None] = {}

    def attempt(b: int) -> int | None:
        nonlocal runs
        if b in results:
            return results[b]
        case = Case(workload, spec, phase, b, "cuda", data=data)
        runs += 1
        progress(f"fit {spec}: run at batch {b} ...")
        results[b] = peak_or_none_on_oom(case) if gpu else predict.predicted_allocated(case, capability)
        return results[b]

    def fits(b: int) -> bool:
        peak = attempt(b)
        return peak is not None and peak <= budget

    good, bad = 0, None
    b = 1
    while b <= max_batch:
        if fits(b):
            good, b = b, b * 2
        else:
            bad = b
            break
    if bad is None:
        bad = max_batch + 1
        if good < max_batch and fits(max_batch):
            good = max_batch
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    method = "measured (None = OOM)" if gpu else "predicted on fake CUDA (None = no prediction)"
    unconfirmed = "" if gpu else "no GPU: predicted (max_memory_allocated on fake CUDA), not confirmed by a run"
    if good == 0:
        return FitResult(spec, phase, "cuda", budget, 0, None, False, results.get(1), method, None,
                         "; ".join(x for x in ("even batch 1 does not fit", unconfirmed) if x), runs if gpu else 0)
    nxt = results.get(good + 1)
    return FitResult(spec, phase, "cuda", budget, good, results[good], gpu, nxt,
                     method if good + 1 in results else "", None,
                     "; ".join(x for x in ("" if good < max_batch else f"capped by --max-batch {max_batch}",
                                           unconfirmed) if x), runs if gpu else 0)


def time_per_sample(spec: str, phase: str, device: str, workload: str, data: str, batch: int,
                    steps: int) -> float:
    """Milliseconds per sample from a short timing run at `batch` (no memory tracking)."""
    case = Case(workload, spec, phase, batch, device, data=data, warmup=0 if device == "cpu" else 1, steps=steps)
    return timing_pass(case, bind_case(case)[0])["step_time_ms_median"] / batch


def fit(specs: list[str], budget: int, phase: str = "train", device: str = "cpu",
        workload: str = "captcha_resnet18", data: str = "synthetic", max_batch: int = 4096,
        time_steps: int = 1, progress: Callable[[str], None] = _quiet,
        capability: tuple[int, int] | None = None, jobs: int = 1, executor: str = pools.LOCAL,
        ray_address: str | None = None) -> list[FitResult]:
    """`fit` for each strategy (baseline first, always included); `time_steps=0` skips the timing run; on CUDA
    without a GPU, `capability` is the predicted device's. On the CPU the fake-tensor probes are made `jobs` at once
    (`pools.probe_pool`); on CUDA the attempts are made one after another whatever `jobs` says.

    `progress` is told each run as it starts and ends (the CLI prints it on stderr)."""
    with pools.opened(pools.probe_pool(jobs, executor, ray_address, __name__, workload)
                      if device == "cpu" else None) as pool:
        return _fit(specs, budget, phase, device, workload, data, max_batch, time_steps, progress, capability, pool)


def _fit(specs: list[str], budget: int, phase: str, device: str, workload: str, data: str, max_batch: int,
         time_steps: int, progress: Callable[[str], None], capability: tuple[int, int] | None,
         pool) -> list[FitResult]:
    specs = ["baseline"] + [s for s in specs if s != "baseline"]
    results = []
    for spec in specs:
        strategy, context = bind_case(Case(workload, spec, phase, 1, device, data=data))
        try:
            strategy.check(context)
        except Unsupported as error:
            results.append(FitResult(strategy.spec(), phase, device, budget, 0, None, False, None, "", None,
                                     f"unsupported: {error}", 0))
            continue
        progress(f"fit {strategy.spec()}: searching for the largest batch under {format_mib(budget)} MiB ...")
        try:
            if device == "cuda":
                result = fit_cuda(strategy.spec(), budget, phase, workload, data, max_batch, progress=progress,
                                  capability=capability)
            else:  # times its answer itself, on the session of its tracked run
                results.append(fit_cpu(strategy.spec(), budget, phase, workload, data, max_batch, progress=progress,
                                       time_steps=time_steps, pool=pool))
                continue
        except Unsupported as error:  # e.g. checkpoint:budget, whose plan is chosen per case, not per batch search
            results.append(FitResult(strategy.spec(), phase, device, budget, 0, None, False, None, "", None,
                                     f"unsupported: {error}", 0))
            continue
        if result.batch_size >= 1 and not result.verified and device == "cuda":
            pass  # predicted without a GPU: nothing to time
        elif result.batch_size >= 1:
            if time_steps > 0:
                progress(f"fit {strategy.spec()}: timing {time_steps} step(s) at batch {result.batch_size} ...")
                result.time_per_sample_ms = time_per_sample(result.strategy, phase, device, workload, data,
                                                            result.batch_size, time_steps)
            else:
                result.note = (result.note + "; " if result.note else "") + "time not measured (--time-steps 0)"
        results.append(result)
    return results


def fit_rows(results: list[FitResult]) -> list[Row]:
    """The rows of the fit table, one per result; a peak of `math.inf` (a tracked run out of memory) is left
    empty, as a peak nobody measured."""
    return [FIT.row({name: None if isinstance(value, float) and math.isinf(value) and name.endswith("_bytes")
                     else value for name, value in asdict(result).items()}) for result in results]


