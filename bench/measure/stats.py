"""Timing statistics over repeats: the pooled median, a 95% confidence interval for it, and a noise flag.

Method: a two-stage (hierarchical) percentile bootstrap of the median step time.
Each bootstrap replicate draws K repeats with replacement, then, inside each drawn repeat, its measured steps
with replacement, and takes the median of all the steps drawn; the interval is the 2.5th..97.5th percentile of
those medians over `BOOTSTRAP_RESAMPLES` replicates.

Why this and not a t-interval over the K per-repeat medians: with the small K a benchmark can afford (1-5)
a t-interval is undefined at K=1 and uselessly wide at K=2-3 (t=12.7 / 4.3), and it assumes normal medians.
The bootstrap needs no distribution, works from K=1 (then it is the ordinary bootstrap of the steps), and
resampling the repeats first keeps the between-process variation (allocator state, thread placement, a busy
neighbour) in the interval instead of pretending that every step is independent. The RNG is seeded with a
fixed seed, so the same times always give the same interval.

Noise: a row is `noisy` when the interval's relative width, (high - low) / median, exceeds `NOISE_THRESHOLD`
(10%): the step time is then not known to better than about +-5%, which is the size of the effects several
strategies have on time, so such a row should not be used to rank strategies by speed.
"""

from __future__ import annotations

from typing import Sequence

import numpy

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 20240601
CONFIDENCE = 0.95
NOISE_THRESHOLD = 0.10  # (ci95_high - ci95_low) / median above this -> noisy


def bootstrap_median_ci(per_repeat: Sequence[Sequence[float]], confidence: float = CONFIDENCE,
                        resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """The percentile-bootstrap interval of the median of all steps, resampling repeats, then steps in each."""
    groups = [numpy.asarray(g, dtype=float) for g in per_repeat if len(g)]
    if not groups:
        raise ValueError("no step times to bootstrap")
    rng = numpy.random.default_rng(seed)
    medians = numpy.empty(resamples)
    k = len(groups)
    for i in range(resamples):
        picked = rng.integers(0, k, size=k) if k > 1 else (0,)
        drawn = [groups[j][rng.integers(0, len(groups[j]), size=len(groups[j]))] for j in picked]
        medians[i] = numpy.median(numpy.concatenate(drawn))
    alpha = (1 - confidence) / 2
    low, high = numpy.quantile(medians, [alpha, 1 - alpha])
    return float(low), float(high)


def summarize_timing(batch_size: int, per_repeat: Sequence[Sequence[float]]) -> dict:
    """The timing columns of a row from the step times (ms) of each repeat: all steps pooled."""
    pooled = numpy.concatenate([numpy.asarray(g, dtype=float) for g in per_repeat])
    median = float(numpy.median(pooled))
    q1, q3 = numpy.percentile(pooled, [25, 75])
    low, high = bootstrap_median_ci(per_repeat)
    low, high = min(low, median), max(high, median)  # the percentile interval always holds the median here
    return {
        "step_time_ms_median": median,
        "step_time_ms_iqr": float(q3 - q1),
        "step_time_ms_min": float(pooled.min()),
        "samples_per_s": batch_size / (median / 1e3),
        "repeats": len(per_repeat),
        "step_time_ms_ci95_low": low,
        "step_time_ms_ci95_high": high,
        "noisy": bool(median > 0 and (high - low) / median > NOISE_THRESHOLD),
    }
