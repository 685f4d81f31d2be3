"""The batch searches of fit, on peaks given as functions of the batch size: the largest batch under a budget
(secant steps, then bisection; or, with several jobs, rounds of probes made at once), the answer of per-stage
lines, and the steps down from an estimate that a tracked run contradicts. No case runs here: `bench.analysis.fit`
passes the peaks it measures or estimates (its tracked runs as `tracked`: `budget`, `peak(batch)`, the `peaks`
measured so far), and its probes as `Probes`, which makes several at once in a pool (`bench.analysis.pools`)."""

from __future__ import annotations

import concurrent.futures as futures
import math
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable


class Probes:
    """The probes of one search, each made once: `probes(x)` is the value at x, made here when not made yet (one
    job: exactly the serial search's probes, in its order); `prefetch(xs)` makes those of `xs` not made yet at once
    in `pool` (`make(*args_at(x))` for each, a module-level function and picklable arguments). A worker that dies
    makes `lost(x, error)` the value, and the search goes on; `told(x, value)` hears of each value made."""

    def __init__(self, make: Callable, args_at: Callable[[int], tuple], pool=None,
                 told: Callable[[int, Any], None] = lambda x, value: None,
                 lost: Callable[[int, BaseException], Any] = lambda x, error: None):
        self.make, self.args_at, self.pool, self.told, self.lost = make, args_at, pool, told, lost
        self.values: dict[int, Any] = {}

    @property
    def jobs(self) -> int:
        return self.pool.slots if self.pool is not None else 1

    def __call__(self, x: int):
        if x not in self.values:
            self.values[x] = self.make(*self.args_at(x))
            self.told(x, self.values[x])
        return self.values[x]

    def prefetch(self, xs: list[int]) -> None:
        missing = [x for x in dict.fromkeys(xs) if x not in self.values]
        if self.pool is None:
            for x in missing:
                self(x)
            return
        running = {self.pool.submit(self.make, *self.args_at(x)): x for x in missing}
        for future in futures.as_completed(running):
            x = running[future]
            try:
                self.values[x] = future.result()
            except self.pool.lost as error:  # a worker died (the OOM killer, a lost node): the probe says so
                self.values[x] = self.lost(x, error)
                if isinstance(error, BrokenProcessPool):
                    self.pool = self.pool.restarted()
            self.told(x, self.values[x])


def largest_in_rounds(peak_at: Callable[[int], float], prefetch: Callable[[list[int]], None], jobs: int,
                      budget: float, top: int, first: list[int], curvature: float | None = None) -> int:
    """The largest x in 1..top with peak_at(x) <= budget (0 if none), for a peak that grows with x, probing up to
    `jobs` points at once each round: `first` (which may lie beyond `top`), then, between the largest x seen to fit
    and the smallest above it seen not to, the point where the polynomial through the probes nearest them crosses
    the budget (`polynomial_guess`: a line or a parabola; with no x seen over the budget yet, extrapolated from
    the largest that fit) and the one after it, and points spread evenly across the bracket (doubling upward while
    none was seen over the budget; the smallest x first while none was seen to fit). After two rounds in a row that
    did not halve the bracket, the even points alone (a safeguard for a strongly curved peak). Where the peak grows with x the answer is the serial
    search's: there is one largest x that fits, and both end on it and on the x after it, probed. `curvature`: a
    second difference to bend the guess by while only two probes place it (`polynomial_guess`)."""
    seen: set[int] = set()

    def probe(points: list[int]) -> None:
        points = [p for p in dict.fromkeys(points) if p >= 1 and p not in seen]
        prefetch(points)
        seen.update(points)

    probe(first)
    width, misses = math.inf, 0  # misses: rounds in a row that did not halve the bracket
    while True:
        fitting = sorted(x for x in seen if x <= top and peak_at(x) <= budget)
        lo = fitting[-1] if fitting else 0
        over = [x for x in seen if x > lo and peak_at(x) > budget]
        hi = min(over, default=top + 1)
        end = min(hi, top + 1)  # the bracket: lo fits, every x in (lo, end) is unknown
        if end - lo <= 1:
            return lo
        misses, width = (0 if end - lo <= width / 2 else misses + 1), end - lo
        points = []
        # one round that did not halve the bracket may still be a guess's: the probes it made are nodes nearer the
        # crossing (a parabola through them places a curved peak's); after two, the even points alone
        guess = polynomial_guess(peak_at, seen, budget, lo, end, curvature) if misses <= 1 else None
        if guess is not None:
            points += [guess, guess + 1]
        if over:
            # nothing fits yet: the smallest x first, which ends the search at once where even it does not fit
            points += ([1] if lo == 0 else []) + [lo + (end - lo) * i // (jobs + 1) for i in range(1, jobs + 1)]
        else:
            d = max(lo, 1)
            for _ in range(jobs):
                d = min(top, 2 * d)
                points.append(d)
        probe([p for p in dict.fromkeys(points) if lo < p < end][:jobs])


def _increasing_polynomial(nodes: list[tuple[int, float]], curvature: float | None = None
                           ) -> Callable[[float], float] | None:
    """The polynomial through `nodes` (two: a line, or with a positive `curvature` the parabola of that second
    difference through them; three: the parabola through them, where it is convex), where it grows from the first node
    on; None where it does not (a peak that is not smooth there: the caller probes evenly instead)."""
    bend = second_difference(nodes) if len(nodes) == 3 else (curvature or 0.0)
    if bend <= 0:
        (a, pa), (b, pb) = nodes[-2:]
        return (lambda x: pa + (pb - pa) * (x - a) / (b - a)) if pb > pa else None
    (a, pa), (b, pb) = nodes[:2]
    d1 = (pb - pa) / (b - a)  # Newton's form: p(x) = pa + d1 (x - a) + bend (x - a)(x - b), convex
    if d1 + bend * (a - b) < 0:  # its vertex lies right of a: it falls somewhere past the first node
        return None
    return lambda x: pa + d1 * (x - a) + bend * (x - a) * (x - b)


def second_difference(nodes: list[tuple[int, float]]) -> float:
    """The second divided difference of three nodes (the x**2 coefficient of the parabola through them)."""
    (a, pa), (b, pb), (c, pc) = nodes
    return ((pc - pb) / (c - b) - (pb - pa) / (b - a)) / (c - a)


def polynomial_guess(peak_at: Callable[[int], float], seen: set[int], budget: float, lo: int, end: int,
                     curvature: float | None = None) -> int | None:
    """Where the peak crosses the budget between `lo` (fits; 0: none yet) and `end` (the first x known not to, or one
    past the largest allowed), on the lowest-degree polynomial through the probes nearest that bracket: memory is a
    line or a parabola in the batch or the tokens between changes of kernel, so two or three probes place the
    crossing. The nodes: the two largest probes that fit and the first known not to (interpolation), or the three
    largest that fit (extrapolation); the parabola through three where it is convex and grows, else the line
    through the two nearest the bracket; with two nodes only and a `curvature` (another search's second difference, a
    strategy's of the same model), the parabola of that bend through them. None where no polynomial through them
    grows. Only a guess of where to probe: the answer is the bracket's, made of probed points."""
    finite = sorted(x for x in seen if math.isfinite(peak_at(x)))
    below, above = [x for x in finite if 0 < x <= lo], [x for x in finite if x >= end]
    near = below[-2:] + above[:1] if above else below[-3:]
    nodes = [(x, peak_at(x)) for x in near]
    if len(nodes) < 2:
        return None
    curve = _increasing_polynomial(nodes, curvature)
    if curve is None:
        return None
    low, high = lo + 1, end - 1  # the largest x in (lo, end) whose value on the curve is <= budget, by bisection
    if high < low:
        return None
    if curve(low) > budget:
        return low
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if curve(middle) <= budget else (low, middle - 1)
    return low


def largest_under(peak_at: Callable[[int], int], budget: int, low: int, high: int, max_batch: int,
                  prefetch: Callable[[list[int]], None] | None = None, jobs: int = 1) -> int:
    """The largest batch b <= max_batch with peak_at(b) <= budget (0 if none), for a peak that grows with the batch.

    Secant steps from `low` and `high` (the peak is linear in the batch within a regime, so they land on the answer
    or next to it in two or three probes), then bisection between the largest batch seen to fit and the smallest
    seen not to, probing upward by doubling when none was seen over the budget. With `jobs` > 1 and a `prefetch`
    that makes several probes at once: `largest_in_rounds` from `low` and `high` (the same answer)."""
    if prefetch is not None and jobs > 1:
        return largest_in_rounds(peak_at, prefetch, jobs, budget, max_batch, [low, high])
    fits = lambda b: b == 0 or peak_at(b) <= budget  # noqa: E731
    a, b = low, high
    for _ in range(6):
        slope = max((peak_at(b) - peak_at(a)) / (b - a), 1.0)
        guess = int(min(max_batch, max(1, b + math.floor((budget - peak_at(b)) / slope))))  # batch 0 is no step
        if guess in (a, b):
            break
        a, b = b, guess
    seen = [0, a, b, b + 1 if b < max_batch else b]
    fit_seen = [x for x in seen if fits(x)]
    lo = max(fit_seen)
    over = [x for x in seen if not fits(x)]
    hi = min(over) if over else None
    while hi is None:
        candidate = min(max_batch, max(1, 2 * lo))
        if candidate == lo:
            return lo
        if fits(candidate):
            lo = candidate
        else:
            hi = candidate
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    # `high` (32) above max_batch may bracket a fitting batch above it: then max_batch fits too (the peak grows)
    return min(lo, max_batch)


def stage_line_estimate(lines: dict[str, tuple[float, float]]) -> Callable[[int], int]:
    """The step's peak at any batch: the highest of the stage lines there."""
    return lambda b: round(max(base_s + slope_s * b for base_s, slope_s in lines.values()))


def largest_on_stage_lines(lines: dict[str, tuple[float, float]], budget: int, max_batch: int) -> int:
    """The largest batch at which every stage's line stays under the budget (0 if none)."""
    batch = max_batch
    for base_s, slope_s in lines.values():
        if slope_s > 0:
            batch = min(batch, math.floor((budget - base_s) / slope_s))
        elif base_s > budget:
            batch = 0
    return max(0, batch)


def confirmed_batch(batch: int, tracked, estimate: Callable[[int], int], method: str,
                    slope: float, low: int, high: int, prefetch: Callable[[list[int]], None] | None = None,
                    jobs: int = 1) -> int:
    """Steps down from `batch` while its actual tracked run is over the budget: by the fake probes shifted by the
    offset the run measured, else by the model's slope (halving after an out-of-memory run); 0 if none fits."""
    budget = tracked.budget
    while batch >= 1 and tracked.peak(batch) > budget:
        over = tracked.peak(batch) - budget
        if over != math.inf and method == "fake probe":
            offset = tracked.peak(batch) - estimate(batch)  # what the CPU holds that fake tensors do not
            batch = min(batch - 1, largest_under(lambda b: estimate(b) + offset, budget, low, high, batch,
                                                 prefetch, jobs))
        else:
            batch -= max(1, batch // 2) if over == math.inf else max(1, math.ceil(over / slope))
    return batch


def next_batch_peak(batch: int, tracked, estimate: Callable[[int], int], method: str,
                    max_batch: int) -> tuple[int | float | None, str, str]:
    """(peak at batch + 1, how it was found, note): measured if that run was made, else the model's step."""
    if batch + 1 in tracked.peaks:
        if tracked.peaks[batch + 1] == math.inf:
            return None, "measured: out of memory", ""
        return tracked.peaks[batch + 1], "measured", ""
    if batch >= max_batch:
        return None, "", f"capped by --max-batch {max_batch}"
    # the model's step from the measured peak: the model itself may be off by a few MiB at large batches
    return tracked.peak(batch) + estimate(batch + 1) - estimate(batch), f"{method} from the measured batch", ""
