"""Fit over the sequence length: the longest sequence (a multiple of a step) whose predicted peak fits a budget, per
strategy, at a fixed batch, on predictions (`bench.analysis.predict`: fake CUDA where it exists), never a real run.

The search exploits that a step's memory does not fall as its tokens grow (`longest_under`: a bracket, then the
crossing of the budget by the line between its ends, one step longer than the answer always probed). That
assumption is checked on every probe the search made: their judged peaks, ordered by length, must be
non-decreasing; a fall is named in the row's `monotonic_check` (and the answer is then not to be trusted).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from bench.analysis import pools, predict
from bench.analysis.fake_cuda_worker import run_in_fake_cuda
from bench.analysis.fit import FitResult
from bench.analysis.fit_search import Probes, largest_in_rounds, second_difference
from bench.core.errors import UsageError
from bench.core.gpus import CUDA_CONTEXT_BYTES
from bench.core.results import Status
from bench.core.units import format_size
from bench.measure import fake_cuda
from bench.run.eta import left_text
from bench.run.preflight import check_seq_len_bounds
from bench.run.case import Case, bind_case
from workloads import get_workload

DEFAULT_SEQ_STEP = 256
LONGEST_DEFAULT = 131072  # the longest sequence tried of a model that does not say its own
START_SEQ = 2048  # where a strategy's search starts (the baseline's starts at one step: it seldom fits at all)
BREAKDOWN = ("weights", "grads", "optimizer_state", "activations", "logits", "other")


@dataclass
class Probe:
    """One predicted sequence length: the peak (max_memory_allocated on CUDA, live bytes on the CPU), what is
    judged against the budget (reserved memory + the CUDA context on CUDA, as `plan` judges; the peak on the CPU),
    and what makes up the peak."""

    seq_len: int
    peak_bytes: int | None
    judged_bytes: int | None
    peak_by: str
    message: str


def seq_len_spec(workload: str, seq_len: int) -> str:
    """`workload` with its `seq_len` option set to `seq_len`, in its canonical spelling; a UsageError for a
    workload without that option."""
    if "seq_len" not in get_workload(workload).options:
        raise UsageError(f"--over seq_len: the workload {workload} has no seq_len option; valid choices: --over "
                         "batch, or a workload with seq_len (e.g. hf:tiny-llama)")
    parts = [part for part in workload.split(":") if not part.startswith("seq_len=")]
    return get_workload(":".join(parts + [f"seq_len={seq_len}"])).spec()


def max_seq_len(workload: str) -> int | None:
    """The longest sequence the workload's model takes (its max_position_embeddings), where it says."""
    configured = get_workload(workload)
    if not hasattr(configured, "config"):
        return None
    return getattr(configured.config(), "max_position_embeddings", None)


def longest_tried(workload: str, step: int, max_seq: int | None) -> int:
    """The longest sequence `--over seq_len` tries: `max_seq`, else the model's max_position_embeddings, else
    LONGEST_DEFAULT; a UsageError naming --seq-step or --max-seq-len where they conflict with each other or the
    model (bench.run.preflight.check_seq_len_bounds), or where the workload has no seq_len option."""
    model_max = max_seq_len(workload)
    check_seq_len_bounds(step, max_seq, model_max, workload)
    seq_len_spec(workload, step)
    return max_seq or model_max or LONGEST_DEFAULT


def peak_by(row) -> str:
    """The largest category at the predicted peak and its share, with the attention kernel and what the backward
    recomputed: what decides the peak."""
    parts = {name: row.get(f"predicted_{name}_bytes") or 0 for name in BREAKDOWN}
    total = sum(parts.values())
    if not total:
        return ""
    largest = max(parts, key=parts.get)
    text = f"{largest} {format_size(parts[largest])} of {format_size(total)} ({parts[largest] / total:.0%})"
    extras = [f"sdpa {row['sdpa_kernel']}" if row.get("sdpa_kernel") else "",
              f"recompute {row['recompute_plan']}" if row.get("recompute_plan") not in (None, "", "none") else ""]
    return "; ".join([text] + [x for x in extras if x])


def predicted_probe(case: Case, capability: tuple[int, int] | None) -> Probe:
    """The probe of one case: `predict`'s row, judged as `plan` judges a candidate."""
    (row,) = predict.predict_cases([case], capability=capability)
    seq_len = get_workload(case.workload).settings["seq_len"]
    if row["status"] != Status.OK.value:
        return Probe(seq_len, None, None, "", f"{row['status']}: {row['message']}")
    judged = (row["predicted_reserved_bytes"] + CUDA_CONTEXT_BYTES if case.device == "cuda"
              else row["predicted_bytes"])
    return Probe(seq_len, row["predicted_bytes"], judged, peak_by(row), row["message"] or "")


def monotonic_check(probes: dict[int, Probe]) -> str:
    """Whether the judged peaks of the probes, by length, never fall: 'non-decreasing over N probes (a..b)', or
    'VIOLATED: ...' naming each fall."""
    known = sorted((p.seq_len, p.judged_bytes) for p in probes.values() if p.judged_bytes is not None)
    falls = [f"{a} -> {b} tokens fell by {pa - pb:,} B" for (a, pa), (b, pb) in zip(known, known[1:]) if pb < pa]
    if falls:
        return "VIOLATED: " + "; ".join(falls)
    span = f" ({known[0][0]}..{known[-1][0]} tokens)" if known else ""
    return f"non-decreasing over {len(known)} probe{'s' if len(known) != 1 else ''}{span}"


def longest_under(judged_at: Callable[[int], int | None], budget: int, step: int, max_seq: int,
                  start: int = START_SEQ, prefetch: Callable[[list[int]], None] | None = None, jobs: int = 1,
                  curvature: float | None = None) -> int:
    """The longest multiple of `step` up to `max_seq` whose judged peak is <= budget (0 if none), for a peak that
    does not fall as the sequence grows; a length with no prediction counts as over the budget.

    A bracket first: `start`, then doubling while it fits (or one step, where `start` does not: a strategy that
    does not fit one step costs two probes). Then, between the longest length seen to fit and the shortest seen not
    to, the point where the straight line between them crosses the budget (at least one step past the fitting end,
    so that the step beyond the answer is always probed), with a bisection after any such step that did not halve
    the bracket (a safeguard for a strongly curved peak).

    With `jobs` > 1 and a `prefetch` that predicts several lengths at once: `fit_search.largest_in_rounds`, from
    `start` and its doublings (`jobs` of them; below `start` those the longest sequence leaves no room for): the
    same answer for a peak that does not fall, in fewer rounds; from `start` = `step`, that length alone first (where
    it does not fit, nothing does: one prediction). `curvature` (bytes per step squared, `curvature_of` another
    strategy's search) bends the rounds' first guess (`fit_search.polynomial_guess`)."""
    max_k = max(1, max_seq // step)
    values: dict[int, float] = {}

    def peak(k: int) -> float:
        if k not in values:
            value = judged_at(k * step)
            values[k] = math.inf if value is None else value
        return values[k]

    k = max(1, min(max_k, start // step))
    if prefetch is not None and jobs > 1:
        # from the smallest length, that one alone: where it does not fit, nothing does, and one prediction said so
        first = [1] if k == 1 else list(dict.fromkeys(min(max_k, k * 2**i) for i in range(jobs)))
        # `start` at or near the longest sequence: the slots left go below it (no doubling is left to make)
        first += [k * i // (jobs - len(first) + 1) for i in range(jobs - len(first), 0, -1)]
        return step * largest_in_rounds(peak, lambda ks: prefetch([x * step for x in ks]), jobs, budget, max_k,
                                        first, curvature)
    if peak(k) > budget:
        if k > 1 and peak(1) > budget:
            return 0
        lo, hi = (1 if k > 1 else 0), k
    else:
        lo, hi = k, None
        while hi is None:
            if lo == max_k:
                return lo * step
            k = min(max_k, 2 * lo)
            lo, hi = (k, None) if peak(k) <= budget else (lo, k)
    interpolate = True
    while hi - lo > 1:
        if interpolate and math.isfinite(peak(hi)) and peak(hi) > peak(lo):
            k = lo + math.floor((budget - peak(lo)) * (hi - lo) / (peak(hi) - peak(lo)))
            k = min(hi - 1, max(lo + 1, k))
        else:
            k = (lo + hi) // 2
        width = hi - lo
        lo, hi = (k, hi) if peak(k) <= budget else (lo, k)
        interpolate = hi - lo <= width // 2
    return lo * step


def curvature_of(probes: dict[int, Probe], longest: int, step: int) -> float | None:
    """The second difference (bytes per step squared) of a search's judged peaks at the shortest and the longest of its
    probes and the one nearest its answer `longest` between them (nodes far apart: the allocator's rounding moves
    neighbours' peaks by megabytes), where it is positive: a strategy's curvature in the tokens, which another
    strategy of the same model shares where both keep the same attention (math attention's tokens-by-tokens matrix);
    None otherwise."""
    known = sorted((n // step, p.judged_bytes) for n, p in probes.items() if p.judged_bytes is not None)
    if len(known) < 3:
        return None
    middle = min(known[1:-1], key=lambda node: abs(node[0] * step - longest - step / 2))
    bend = second_difference([known[0], middle, known[-1]])
    return bend if bend > 0 else None


def probes_left(judged: dict[int, int | None], budget: int, step: int, limit: int) -> int:
    """About how many more probes `longest_under` makes, from the judged peaks so far (by length; None: no
    prediction, over the budget): none once the longest length seen to fit is followed by one seen not to; within a
    bracket, a bisection's count (interpolation usually needs fewer); with no length seen over the budget yet, the
    doublings left to the longest sequence and two to close the bracket. A progress line's estimate only."""
    fitting = [n for n, value in judged.items() if value is not None and value <= budget]
    lo = max(fitting, default=0)
    over = [n for n, value in judged.items() if n > lo and (value is None or value > budget)]
    if over:
        width = (min(over) - lo) // step
        return math.ceil(math.log2(width)) if width > 1 else 0
    if lo >= limit - limit % step:
        return 0
    return math.ceil(math.log2(limit / lo)) + 2 if lo else 2


def _lost_probe(seq_len: int, error: BaseException) -> Probe:
    first = next((line for line in str(error).splitlines() if line.strip()), "").strip()
    return Probe(seq_len, None, None, "", f"error: its worker died ({type(error).__name__}: {first})"[:300])


def fit_seq_len(spec: str, budget: int, phase: str, device: str, workload: str, data: str, batch: int,
                step: int = DEFAULT_SEQ_STEP, max_seq: int | None = None, capability: tuple[int, int] | None = None,
                start: int = START_SEQ, progress: Callable[[str], None] = lambda text: None,
                judged_at: Callable[[int], Probe] | None = None, pool=None,
                known: dict[int, Probe] | None = None, curvature: float | None = None,
                made: dict[int, Probe] | None = None) -> FitResult:
    """The longest sequence (a multiple of `step`) whose predicted peak fits `budget` for strategy `spec` at batch
    `batch`: a row of the fit table with `over` = seq_len. `judged_at` replaces the prediction (a test's peaks).
    With a `pool` of several jobs (`bench.analysis.pools`) the lengths are predicted several at once. `known`:
    probes already made (by length), not made again. `curvature`: `longest_under`'s. `made`, where given, receives
    every probe of the search, by length."""
    limit = max_seq or max_seq_len(workload) or LONGEST_DEFAULT  # its callers checked the bounds (longest_tried)

    started = time.monotonic()

    def told(seq_len: int, p: Probe) -> None:
        judged = {n: probe.judged_bytes for n, probe in probes.values.items()}
        left = probes_left(judged, budget, step, limit)
        made = len(judged) - len(known or {})
        progress(f"fit {spec}: seq_len {seq_len}: " + (
            p.message if p.judged_bytes is None else
            f"judged {format_size(p.judged_bytes)} vs budget {format_size(budget)}")
            + f" [{made} probes made; {left_text(left, made, time.monotonic() - started)}]")

    def args_at(seq_len: int) -> tuple:
        if judged_at is not None:
            return (seq_len,)
        return Case(seq_len_spec(workload, seq_len), spec, phase, batch, device, data=data), capability

    probes = Probes(judged_at or predicted_probe, args_at, pool, told, _lost_probe)
    probes.values.update(known or {})
    longest = longest_under(lambda seq_len: probes(seq_len).judged_bytes, budget, step, limit, start,
                            probes.prefetch, probes.jobs, curvature)
    probes = probes.values
    if made is not None:
        made.update(probes)
    check = monotonic_check(probes)
    nxt = probes.get(longest + step)
    notes = ["predicted, not confirmed by a run"]
    if device == "cuda":
        notes.append(f"judged: reserved + {CUDA_CONTEXT_BYTES / 2**20:.0f} MiB CUDA context")
    if longest + step > limit:
        notes.append(f"capped by the longest sequence, {limit}")
    if longest == 0:
        first = probes.get(step)
        why = (first.message if first is not None and first.judged_bytes is None
               else f"even seq_len {step} does not fit")
        return FitResult(spec, phase, device, budget, batch, None, False,
                         first.peak_bytes if first else None, "predicted", None, "; ".join([why] + notes), 0,
                         over="seq_len", seq_len=0, seq_len_step=step, next_judged_bytes=first.judged_bytes if first else None,
                         monotonic_check=check)
    answer = probes[longest]
    if answer.message:
        notes.append(answer.message)
    return FitResult(spec, phase, device, budget, batch, answer.peak_bytes, False,
                     nxt.peak_bytes if nxt else None, "predicted" if nxt else "", None, "; ".join(notes), 0,
                     over="seq_len", seq_len=longest, seq_len_step=step, judged_bytes=answer.judged_bytes,
                     next_judged_bytes=nxt.judged_bytes if nxt else None, peak_by=answer.peak_by,
                     monotonic_check=check)


def searched_specs(specs: list[str]) -> list[str]:
    """The strategies `fit --over seq_len` searches: `predict.predicted_specs` (the baseline only where asked for
    or where no strategy is named). Where it is searched, its search starts at the shortest length, that one alone
    (`fit_over_seq_len`): where that does not fit, one prediction is its answer."""
    return predict.predicted_specs(specs)


def fit_over_seq_len(specs: list[str], budget: int, phase: str, device: str, workload: str, data: str, batch: int,
                     step: int = DEFAULT_SEQ_STEP, max_seq: int | None = None,
                     capability: tuple[int, int] | None = None,
                     progress: Callable[[str], None] = lambda text: None, jobs: int = 1,
                     executor: str = pools.LOCAL, ray_address: str | None = None) -> list[FitResult]:
    """`fit_seq_len` for each strategy of `searched_specs(specs)`; its predictions `jobs` at once in local worker
    processes, or as Ray tasks with `executor="ray"` (`bench.analysis.pools.probe_pool`).

    A CUDA search in a torch that sees no CUDA device runs whole in the fake-CUDA environment's Python, one process
    for every probe (`python -m bench.analysis._fit_worker`): each probe there is a prediction in that process, not a
    new process started per probe (seconds of imports each); the same probes, so the same rows. Where that process
    fails, the search runs here, each probe in a process of its own."""
    longest_tried(workload, step, max_seq)  # no seq_len option, or bounds that conflict: before any prediction
    specs = searched_specs(specs)
    if device == "cuda" and executor == pools.LOCAL and not torch.cuda.is_available():
        python = fake_cuda.environment_python()
        if python is not None:
            request = {"specs": specs, "budget": budget, "phase": phase, "device": device, "workload": workload,
                       "data": data, "batch": batch, "step": step, "max_seq": max_seq,
                       "capability": list(capability) if capability else None, "jobs": jobs}
            rows, _ = run_in_fake_cuda(python, "bench.analysis._fit_worker", request)
            if rows is not None:
                return [FitResult(**row) for row in rows]
    results = []
    started = time.monotonic()
    curvature = None  # the last strategy's, which bends the next one's first guess: they share the model's attention
    with pools.opened(pools.probe_pool(jobs, executor, ray_address, __name__, workload)) as pool:
        for index, spec in enumerate(specs):
            canonical = bind_case(Case(workload, spec, phase, batch, "cpu", data=data))[0].spec()
            after = (f"; {left_text(len(specs) - index, index, time.monotonic() - started, 'strategies')} with this one"
                     if len(specs) > 1 else "")
            progress(f"fit {canonical} (strategy {index + 1} of {len(specs)}{after}): searching for the longest "
                     f"sequence under {format_size(budget)} ...")
            # the baseline from the shortest length: at full size it seldom fits at any, which one prediction shows
            start = step if canonical == "baseline" else START_SEQ
            made: dict[int, Probe] = {}
            results.append(fit_seq_len(canonical, budget, phase, device, workload, data, batch, step, max_seq,
                                       capability, start, progress=progress, pool=pool, curvature=curvature,
                                       made=made))
            curvature = curvature_of(made, results[-1].seq_len or 0, step) or curvature
    return results
