"""How long the rest of a sweep will take, and how long a case whose 16-bit arithmetic the CPU emulates will take.

Estimates only, from what this sweep has measured so far: a case's time is taken from the finished case most like
it (the same strategy at another batch size, scaled by the batch; else the baseline at the same batch), and a case
that autocasts to a 16-bit type the CPU has no instructions for (bench.measure.cpu_16bit decides) from the baseline's
step time times the slowdown of 16-bit against float32 arithmetic, measured on this machine once per process
(`emulated_slowdown`), and the steps of the emulated path (bench.run.runner: a verification at a small batch,
memory on fake tensors, capped timing).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from bench.measure import cpu_16bit
from bench.run.passes import step_times
from bench.run.case import Case, bind_case
from bench.run.runner import EMULATED_VERIFY_BATCH, MEMORY_GROWTH_STEPS, MEMORY_WARMUP_STEPS, emulated_timing_case

# bfloat16 autocast emulated on a CPU without bfloat16 instructions, against the float32 baseline, 2 threads, AMD
# EPYC (results/reference/captcha_no_bf16): amp 14.6x (train, batch 100) to 23.0x (eval, batch 100),
# checkpoint+amp 18.6x.
# The reference figure `python -m bench env` quotes; the estimates use `emulated_slowdown`, measured where they run.
EMULATED_SLOWDOWN = (15.0, 23.0)
# The calibration of `emulated_slowdown`: a matrix product and a convolution the size of a small model's layers
# (a few milliseconds each in float32), each timed SLOWDOWN_REPEATS times after one untimed call, in float32 and
# under autocast to the 16-bit type (its casts included, as in a step).
SLOWDOWN_MATMUL = (256, 256, 256)
SLOWDOWN_CONV = ((8, 32, 28, 28), (32, 32, 3, 3))
SLOWDOWN_REPEATS = 3


def case_steps(case: Case, step_s: float) -> int:
    """How many steps a case runs in all, for a step of `step_s` seconds: one to verify, the timing pass (warm-up,
    then its fixed count, or adaptive: at least `min_steps`, more while the budget lasts; the estimate assumes the
    budget, not the interval, stops it) and the memory pass (warm-up, the measured step, the growth steps)."""
    if case.steps is not None:
        timed = case.steps
    else:
        timed = max(case.min_steps, math.ceil(case.max_time_s / max(step_s, 1e-9)))
    memory = MEMORY_WARMUP_STEPS.get(case.device, 1) + 1 + MEMORY_GROWTH_STEPS
    return 1 + case.warmup + timed + memory


def _median_seconds(call: Callable[[], object]) -> float:
    call()
    times = []
    for _ in range(SLOWDOWN_REPEATS):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


@functools.lru_cache(maxsize=None)
def emulated_slowdown(dtype: str = "bfloat16") -> tuple[float, float]:
    """(low, high): how much slower a matrix product and a convolution run under CPU autocast to `dtype` than in
    float32, measured on this machine (about a tenth of a second where 16-bit is native, a second where it is
    emulated), once per process. A step's slowdown lies near this range: its other operators (element-wise, the
    optimizer) stay in float32."""
    generator = torch.Generator().manual_seed(0)
    m, k, n = SLOWDOWN_MATMUL
    a, b = torch.randn(m, k, generator=generator), torch.randn(k, n, generator=generator)
    image, weight = (torch.randn(shape, generator=generator) for shape in SLOWDOWN_CONV)
    ratios = []
    for op in (lambda: a @ b, lambda: torch.nn.functional.conv2d(image, weight, padding=1)):
        with torch.no_grad():
            full = _median_seconds(op)
            with torch.autocast("cpu", dtype=getattr(torch, dtype)):
                half = _median_seconds(op)
        ratios.append(half / max(full, 1e-9))
    return min(ratios), max(ratios)


def emulated_case_seconds(case: Case, baseline_step_ms: float,
                          slowdown: tuple[float, float] | None = None) -> tuple[float, float]:
    """The (low, high) estimate of an emulated 16-bit case's time on the emulated path, from the float32 baseline's
    step time and `slowdown` (default: `emulated_slowdown` of the case's dtype, measured here): the verification
    (the strategy's step and the baseline's at the small batch) and the timing (at least one step, else its
    budget); its memory, counted on fake tensors, takes seconds and is left out."""
    if slowdown is None:
        slowdown = emulated_slowdown(cpu_16bit.autocast_dtype(bind_case(case)[0]) or "bfloat16")
    budget = emulated_timing_case(case).max_time_s
    small = min(case.batch_size, EMULATED_VERIFY_BATCH) / case.batch_size
    estimates = []
    for factor in slowdown:
        step_s = baseline_step_ms / 1e3 * factor
        estimates.append(step_s * small + baseline_step_ms / 1e3 * small + max(step_s, budget))
    return min(estimates), max(estimates)


def emulation_warning(case: Case, dtype: str, cpu: str, baseline_step_ms: float | None,
                      slowdown: tuple[float, float] | None = None) -> str:
    """The line printed before an emulated case starts: what is emulated, how much slower this machine runs it
    (`slowdown`, default measured now: `emulated_slowdown`), and for how long."""
    low, high = slowdown or emulated_slowdown(dtype)
    cap = cpu_16bit.onednn_cap_emulating(dtype)
    why = (f"which oneDNN, capped at {cap[1]} by {cap[0]}, runs without this CPU's ({cpu}) {dtype} instructions"
           if cap else f"which this CPU ({cpu}) has no instructions for")
    text = (f"note: {case.strategy} autocasts to {dtype}, {why}: PyTorch "
            f"emulates it in float32 ({low:.1f}-{high:.1f}x float32's time for a {dtype} matrix product and "
            "convolution, measured here); verified at a small batch, memory counted on fake tensors, timing capped")
    if baseline_step_ms is None:
        return text + "; no baseline time yet to estimate this case from"
    low_s, high_s = emulated_case_seconds(case, baseline_step_ms, (low, high))
    return text + f"; this case: about {duration(low_s)} to {duration(high_s)}"


# The batch sizes of the calibration before a CPU sweep's first case: two real baseline steps each, about a second in
# all for captcha_resnet18 (43 ms + 10.7 ms a sample on a 2-thread Xeon); a line through them gives the full batch.
CALIBRATION_BATCHES = (4, 8)
# The first steps of a case (verification, warm-up, the memory pass's) run slower than the steady step the line
# predicts (first touches of the batch's memory): captcha_resnet18 at batch 100 on the CPU took 57 s against the
# 39 s of its steady steps. The estimate is given as a range up to this factor.
FIRST_STEPS_FACTOR = 2.0
# The form a note suggests for a first row within a minute on the CPU
QUICK_FORM = "--quick --batch-size 8"


def calibrated_step_seconds(case: Case, measure: Callable[[Case], float] | None = None) -> Callable[[int], float]:
    """Seconds per steady step of `case`'s baseline as a function of the batch size: a line through two real
    steps at each of CALIBRATION_BATCHES (`measure(case)`: a case's median step in seconds; default a timing pass).

    Limitations: a line through small batches misses cache effects at large ones (a quarter low at batch 100)."""
    measure = measure or _median_step_seconds
    low, high = CALIBRATION_BATCHES
    at = {bs: measure(replace(case, strategy="baseline", batch_size=bs, warmup=1, steps=2, min_steps=1))
          for bs in (low, high)}
    per_sample = max((at[high] - at[low]) / (high - low), 0.0)
    return lambda batch_size: max(at[low] + per_sample * (batch_size - low), 1e-6)


def _median_step_seconds(case: Case) -> float:
    times = sorted(step_times(case, bind_case(case)[0]).times_ms)
    return times[len(times) // 2] / 1e3


def first_case_note(case: Case, step_seconds: Callable[[int], float]) -> tuple[str, bool]:
    """The header's line on how long the first case will take (`step_seconds(batch)`: calibrated_step_seconds'),
    and whether that may be over a minute (then the line also gives QUICK_FORM and how long it would take)."""
    step_s = step_seconds(case.batch_size)
    low = case_steps(case, step_s) * step_s
    high = low * FIRST_STEPS_FACTOR
    text = (f"the first case ({case.label()}) will take about {duration(low)} to {duration(high)} (a step at batch "
            f"{case.batch_size} calibrated at {step_s * 1e3:.1f} ms here)")
    if high <= 60:
        return text, False
    quick = replace(case, batch_size=min(case.batch_size, 8), warmup=1, steps=3)
    quick_s = case_steps(quick, step_seconds(quick.batch_size)) * step_seconds(quick.batch_size) * FIRST_STEPS_FACTOR
    return text + f"; {QUICK_FORM} gives a first row after about {duration(quick_s)} of steps", True


def duration(seconds: float) -> str:
    """`42s`, `3m05s`, `1h02m`."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def left_text(left: int, done: int, elapsed_s: float, what: str = "probes", at_most: bool = False) -> str:
    """What a search's progress line says of what remains: `left` more of `what` (`at_most`: an upper bound) and
    the time they take at the mean wall time of the `done` ones so far (`elapsed_s` for all of them); the time is
    left out before any is done. E.g. "about 3 probes left, ~1m20s"."""
    count = f"{'at most' if at_most else 'about'} {left} {what} left"
    if left <= 0:
        return f"no {what} left"
    if done <= 0:
        return count
    return f"{count}, ~{duration(elapsed_s / done * left)}"


@dataclass
class SweepEstimate:
    """The sweep's cases, which of them are emulated (their 16-bit dtype), and each finished case's seconds and row;
    `seconds_left()` estimates what remains."""

    cases: list[Case]
    emulated: dict[int, str] = field(default_factory=dict)  # index -> dtype
    seconds: dict[int, float] = field(default_factory=dict)
    rows: dict[int, dict] = field(default_factory=dict)

    def finished(self, index: int, seconds: float, row: dict) -> None:
        """Records a finished case."""
        self.seconds[index] = seconds
        self.rows[index] = row

    def baseline_step_ms(self, case: Case) -> float | None:
        """The step time of the finished `ok` baseline with the case's workload, phase, batch size and data."""
        for index, row in self.rows.items():
            other = self.cases[index]
            if (other.strategy == "baseline" and row.get("status") == "ok"
                    and (other.workload, other.phase, other.batch_size, other.data)
                    == (case.workload, case.phase, case.batch_size, case.data)):
                return float(row["step_time_ms_median"])
        return None

    def case_seconds(self, index: int) -> float | None:
        """The estimate for one unfinished case (None when nothing alike has finished)."""
        case = self.cases[index]
        alike = [(abs(math.log(self.cases[i].batch_size / case.batch_size)), i) for i in self.seconds
                 if (self.cases[i].workload, self.cases[i].strategy, self.cases[i].phase, self.cases[i].data)
                 == (case.workload, case.strategy, case.phase, case.data)]
        if alike:
            nearest = min(alike)[1]
            return self.seconds[nearest] * case.batch_size / self.cases[nearest].batch_size
        step_ms = self.baseline_step_ms(case)
        if index in self.emulated and step_ms is not None:
            return sum(emulated_case_seconds(case, step_ms, emulated_slowdown(self.emulated[index]))) / 2
        for i in self.seconds:
            other = self.cases[i]
            if other.strategy == "baseline" and (other.workload, other.phase, other.batch_size, other.data) == (
                    case.workload, case.phase, case.batch_size, case.data):
                return self.seconds[i]
        return None

    def seconds_left(self, running: int | None = None, running_for: float = 0.0) -> float | None:
        """The estimated seconds until every case has finished; `running` is the index of the case under way, for
        `running_for` seconds. Cases with no estimate count as the mean finished case; None before any finished."""
        if not self.seconds:
            return None
        mean = sum(self.seconds.values()) / len(self.seconds)
        left = 0.0
        for index in range(len(self.cases)):
            if index in self.seconds:
                continue
            estimate = self.case_seconds(index)
            estimate = mean if estimate is None else estimate
            if index == running:
                estimate = max(estimate - running_for, 0.0)
            left += estimate
        return left


def sweep_estimate(cases: list[Case]) -> SweepEstimate:
    """A SweepEstimate of the cases, knowing which autocast to a 16-bit type this CPU emulates."""
    emulated = {}
    for index, case in enumerate(cases):
        try:
            strategy = bind_case(case)[0]
        except Exception:  # noqa: BLE001 - a case that cannot bind fails as a row of its own; no estimate for it
            continue
        dtype = cpu_16bit.emulated_dtype(strategy, case.device)
        if dtype is not None:
            emulated[index] = dtype
    return SweepEstimate(list(cases), emulated)
