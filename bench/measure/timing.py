"""Step timing: synchronised wall times of measured steps, the adaptive stopping rule, and the median's interval.

Timing and memory are measured in separate passes: nothing here tracks memory.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy
import torch

from bench.core import progress



@dataclass
class TimingStats:
    """Per-step wall times of the measured steps, in milliseconds, and why the timing stopped."""

    times_ms: list[float]
    stop_reason: str = "fixed_steps"

    @property
    def median_ms(self) -> float:
        return float(numpy.median(self.times_ms))

    @property
    def iqr_ms(self) -> float:
        q1, q3 = numpy.percentile(self.times_ms, [25, 75])
        return float(q3 - q1)

    @property
    def min_ms(self) -> float:
        return float(min(self.times_ms))


# Why a timing pass stopped (the row's `timing_stop_reason`).
STOP_REASONS = ("fixed_steps", "ci_target", "time_budget", "max_steps")
# An adaptive pass never runs more measured steps than this (a step of microseconds with noise that never settles).
ADAPTIVE_MAX_STEPS = 10_000
CI_CONFIDENCE = 0.95
# Above this many steps the binomial is replaced by its normal approximation (checked up to 10,000 steps: the rank
# differs from the exact one by at most one).
_EXACT_RANKS_UP_TO = 200


@dataclass(frozen=True)
class TimingPolicy:
    """How many steps the timing pass measures.

    `steps` set: exactly that many (`fixed_steps`). `steps` None: adaptive, in the spirit of
    torch.utils.benchmark's `blocked_autorange` and pyperf's calibration: at least `min_steps`, then stop as soon
    as the median's 95% interval (`median_ci`) is narrower than `target_ci_rel` of the median (`ci_target`), or
    once `max_time_s` seconds of measured steps have run (`time_budget`), whichever comes first. The warm-up steps
    are not counted in the budget; a step is never cut short, so the pass may overrun it by one step."""

    warmup: int = 3
    steps: int | None = None
    min_steps: int = 5
    max_time_s: float = 60.0
    target_ci_rel: float = 0.05
    max_steps: int = ADAPTIVE_MAX_STEPS

    @property
    def adaptive(self) -> bool:
        return self.steps is None


@functools.lru_cache(maxsize=4096)
def median_ci_ranks(n: int, confidence: float = CI_CONFIDENCE) -> tuple[int, int] | None:
    """The 1-based ranks (j, n + 1 - j) of the order statistics that bound the median with at least `confidence`.

    Distribution-free: the number of steps below the true median is Binomial(n, 1/2), so
    P(x_(j) <= median <= x_(n+1-j)) = 1 - 2 P(B <= j - 1); j is the largest rank that keeps this >= confidence.
    None when even the whole range is not enough (n < 6 at 95%: 1 - 2 / 2^n < 0.95)."""
    alpha = 1 - confidence
    if n > _EXACT_RANKS_UP_TO:
        j = int(math.floor(n / 2 - statistics.NormalDist().inv_cdf(1 - alpha / 2) * math.sqrt(n) / 2))
        return max(j, 1), n + 1 - max(j, 1)
    cumulative, j = 0.0, 0
    for k in range(n // 2 + 1):
        cumulative += math.comb(n, k) / 2.0**n  # P(B <= k)
        if 2 * cumulative > alpha:
            break
        j = k + 1
    return (j, n + 1 - j) if j >= 1 else None



def median_ci(times: list[float], confidence: float = CI_CONFIDENCE) -> tuple[float, float] | None:
    """The distribution-free interval of the median from order statistics (see `median_ci_ranks`); None if too few."""
    ranks = median_ci_ranks(len(times), confidence)
    if ranks is None:
        return None
    ordered = sorted(times)
    return ordered[ranks[0] - 1], ordered[ranks[1] - 1]


def median_ci_rel_width(times: list[float]) -> float | None:
    """(high - low) / median of `median_ci`; None below 6 steps."""
    interval = median_ci(times)
    median = float(numpy.median(times)) if times else 0.0
    if interval is None or median <= 0:
        return None
    return (interval[1] - interval[0]) / median


def synchronize(device: str) -> None:
    """Waits for queued device work, so that a timer measures the work and not just its launch."""
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(step: Callable[[], None], policy: TimingPolicy, device: str,
               clock: Callable[[], float] = time.perf_counter) -> TimingStats:
    """Runs `policy.warmup` untimed steps, then times steps one by one with the device synchronised around each,
    as many as `policy` says (see TimingPolicy); `clock` (seconds) is injectable for tests.

    The stopping rule and progress (`bench.core.progress`) run after each step, outside the timed span."""
    for index in range(policy.warmup):
        step()
        progress.report("warm-up", index + 1, policy.warmup)
    times: list[float] = []
    started = clock()
    while True:
        synchronize(device)
        start = clock()
        step()
        synchronize(device)
        times.append((clock() - start) * 1e3)
        reason = _agreed_by_every_rank(_stop_reason(policy, times, clock() - started), policy, device)
        progress.report("timing", len(times), policy.steps or 0)
        if reason:
            return TimingStats(times, reason)


def _agreed_by_every_rank(reason: str | None, policy: TimingPolicy, device: str) -> str | None:
    """On ranks (a process group of more than one), the reason every rank stops for after this step: an adaptive
    pass decides on each rank's own times, and a rank that stopped alone would leave the others in a collective of
    the next step (gloo: "Connection closed by peer" once it exits). Every rank stops with the first to stop; where
    several stop at once, for the reason latest in STOP_REASONS."""
    if not policy.adaptive or not torch.distributed.is_available() or not torch.distributed.is_initialized() \
            or torch.distributed.get_world_size() == 1:
        return reason
    code = torch.tensor([STOP_REASONS.index(reason) + 1 if reason else 0],
                        device=torch.cuda.current_device() if device == "cuda" else "cpu")
    torch.distributed.all_reduce(code, op=torch.distributed.ReduceOp.MAX)
    agreed = int(code.item())
    return STOP_REASONS[agreed - 1] if agreed else None


def _stop_reason(policy: TimingPolicy, times: list[float], elapsed_s: float) -> str | None:
    """Why the pass stops after these steps, or None to go on."""
    if not policy.adaptive:
        return "fixed_steps" if len(times) >= policy.steps else None
    if len(times) < policy.min_steps:
        return None
    width = median_ci_rel_width(times)
    if width is not None and width <= policy.target_ci_rel:
        return "ci_target"
    if elapsed_s >= policy.max_time_s:
        return "time_budget"
    if len(times) >= policy.max_steps:
        return "max_steps"
    return None
