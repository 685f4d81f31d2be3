"""Plan over the sequence length (`plan --over seq_len`): the combination of techniques that trains the longest
sequence within a memory limit at a fixed batch, on predictions (`bench.analysis.fit_seq_len`'s probes), never a run.

The candidates are plan's (`bench.analysis.plan_candidates`): the baseline, every declared setting alone, then pairs
and triples of the settings that alone reached a longer sequence than the baseline (a triple once its three pairs
ran). A step's memory does not fall as its tokens grow (fit_seq_len's assumption, checked on the probes of every
candidate searched), so one probe settles most candidates: one whose judged peak one step past the longest sequence
found so far is over the limit cannot be the answer, and is not searched further (its row says so, with that
probe). A setting alone is probed one step past the baseline's longest instead: that decides whether it enters the
combinations. The others are searched to their own longest (`fit_seq_len.fit_seq_len`, from the probe that fitted).

The answer is the longest sequence among the candidates that train what the baseline trains (with
`allow_different`, any); on a tie, the one with fewer techniques, then the smaller judged peak (no time is
estimated here: `plan` at that length ranks the tied ones by speed). A search cut short by `max_candidates` or
`max_search_s` names the candidates it did not try.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from bench.analysis import fit_seq_len, plan, plan_candidates, pools
from bench.analysis.fit import FitResult
from bench.analysis.plan_search import COUNT, TIME
from bench.run.case import Case
from strategies import PlanSpace

SEARCH_START = 2048  # the baseline's search brackets from here; the others' from their first probe


@dataclass
class SeqLenSearch:
    """Every candidate's row (the baseline first, in the order tried), the answer, why the search stopped early
    (None, `time` or `count`) and what it then did not try, and why each candidate kept out of the answer differs."""

    results: list[FitResult]
    answer: FitResult | None
    stopped: str | None = None
    untried: list[str] = field(default_factory=list)
    differs: dict[str, str] = field(default_factory=dict)
    tied: list[str] = field(default_factory=list)  # the other candidates that reach the answer's length
    seconds: float = 0.0


def _members(spec: str) -> int:
    return 0 if spec == "baseline" else spec.count("+") + 1


def longest_plan(request: plan.PlanRequest, step: int = fit_seq_len.DEFAULT_SEQ_STEP, max_seq: int | None = None,
                 progress: Callable[[str], None] = lambda text: None, jobs: int = 1, executor: str = pools.LOCAL,
                 ray_address: str | None = None, probe: Callable[[Case], fit_seq_len.Probe] | None = None
                 ) -> SeqLenSearch:
    """The search above for `request` (its batch, device, capability, limit and strategies; one rank). Each
    searched candidate's probes run `jobs` at once (`bench.analysis.pools.probe_pool`); `probe` replaces the
    prediction of one case (a test's peaks), and then every probe is made here."""
    workload, budget = request.workload, request.limit_bytes
    # a workload without seq_len, or a step or bound that conflict: a UsageError before any prediction
    longest_known = fit_seq_len.longest_tried(workload, step, max_seq)
    context = plan.bind_for_plan(request.case("baseline"), 1)[1]
    accepted, _ = plan_candidates.settings(PlanSpace(context, max(1, budget - request.context_bytes)))
    if request.strategies:
        accepted = [s for s in accepted if s.strategy in request.strategies]
    started = time.monotonic()
    found = SeqLenSearch([], None)
    by_spec: dict[str, FitResult] = {}

    def case_at(spec: str, seq_len: int) -> Case:
        return Case(fit_seq_len.seq_len_spec(workload, seq_len), spec, "train", request.batch_size, request.device,
                    data=request.data)

    def probe_at(spec: str, seq_len: int) -> fit_seq_len.Probe:
        case = case_at(spec, seq_len)
        made = probe(case) if probe else fit_seq_len.predicted_probe(case, request.capability)
        progress(f"plan {spec}: seq_len {seq_len}: " + (made.message if made.judged_bytes is None else
                 f"judged {made.judged_bytes / 2**20:,.1f} MiB of {budget / 2**20:,.1f}"))
        return made

    def best_eligible() -> int:
        return max((r.seq_len or 0 for r in found.results if r.strategy not in found.differs), default=0)

    def consider(spec: str, floor: int, pool) -> FitResult:
        """`spec`'s row: searched to its longest where it fits `floor` tokens, else the probe that rules it out."""
        canonical = plan.bind_for_plan(request.case(spec), 1)[0]
        spec = canonical.spec()
        why = canonical.differs_by_design()
        if why and not request.allow_different:
            found.differs[spec] = why
        progress(f"plan {spec}: does it fit {floor} tokens ...")
        first = probe_at(spec, floor) if floor <= longest_known else None
        if first is None or first.judged_bytes is None or first.judged_bytes > budget:
            over = ("beyond the longest sequence tried" if first is None else first.message if
                    first.judged_bytes is None else f"over the limit at {floor} tokens")
            why_not = ("the shortest tried" if floor == step else "one step past the longest found so far: it "
                       "cannot reach further, not searched further")
            result = FitResult(spec, "train", request.device, budget, request.batch_size, None, False,
                               first.peak_bytes if first else None, "predicted" if first else "", None,
                               f"shorter than {floor} tokens ({over}, {why_not}); predicted, not confirmed by a run",
                               0, over="seq_len", seq_len=None, seq_len_step=step,
                               next_judged_bytes=first.judged_bytes if first else None)
        else:
            kwargs = {"judged_at": lambda n: probe_at(spec, n)} if probe else {"pool": pool}
            result = fit_seq_len.fit_seq_len(spec, budget, "train", request.device, workload, request.data,
                                             request.batch_size, step, longest_known, request.capability,
                                             start=SEARCH_START if floor == step else floor, progress=progress,
                                             known={floor: first}, **kwargs)
        found.results.append(result)
        by_spec[spec] = result
        return result

    def may_start() -> bool:
        if time.monotonic() - started > request.max_search_s:
            found.stopped = found.stopped or TIME
        elif len(found.results) >= request.max_candidates:
            found.stopped = found.stopped or COUNT
        return found.stopped is None

    pool_jobs = 1 if probe else jobs
    with pools.opened(pools.probe_pool(pool_jobs, executor, ray_address, fit_seq_len.__name__, workload)) as pool:
        base = consider("baseline", step, pool)
        base_longest = base.seq_len or 0
        useful = []
        for setting in accepted:
            if not may_start():
                found.untried.append(setting.spec)
                continue
            result = consider(setting.spec, base_longest + step, pool)
            if (result.seq_len or 0) > base_longest and result.strategy not in found.differs:
                useful.append(setting)
        for size in (2, 3):
            for members in itertools.combinations(useful, size):
                spec = plan_candidates.compose(members, context)
                if spec is None or spec in by_spec:
                    continue
                if size == 3 and any(plan_candidates.compose(pair, context) not in by_spec
                                     for pair in itertools.combinations(members, 2)):
                    continue
                if not may_start():
                    found.untried.append(spec)
                    continue
                consider(spec, best_eligible() + step, pool)
    eligible = [r for r in found.results if r.seq_len and r.strategy not in found.differs]
    if eligible:
        found.answer = max(eligible, key=lambda r: (r.seq_len, -_members(r.strategy), -r.judged_bytes))
        found.tied = [r.strategy for r in eligible if r.seq_len == found.answer.seq_len and r is not found.answer]
    found.seconds = time.monotonic() - started
    return found
