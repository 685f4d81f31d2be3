"""How many GPUs: the fewest ranks on which some plan fits, with that plan and each rank count's best (`plan
--max-ranks N`).

One rank is the ordinary plan (`plan_search.search`); at two ranks and more only candidates with a sharded member
run (ddp, zero1, zero2, zero3, fsdp with and without offload, and the dp x tp meshes `fsdp+tp:degree=T` whose degree
divides the model's heads and `--gpus-per-node`: `TensorParallel.plan_settings`; with the other techniques), each
rank's step predicted in one process (PyTorch's fake process group), since a candidate that shards nothing needs
on N GPUs what it needs on one: those rows come from the one-rank search, which the later searches also combine
from. `--batch-size` is each rank's batch, as torchrun's ranks each
load their own, so the step's batch grows with the ranks; `--global-batch-size` fixes the step's batch instead,
split across the ranks, and then no more ranks than samples are tried.

The rank counts are searched, not walked: 1, 2, 4, 8, ... (and the largest allowed) until one has an answer, then by
halves between the largest count without one and that count until at most SCANNED_GAP counts lie between them,
which are all tried, fewest first. The halving rests on a plan's per-GPU memory not growing with the rank count
(a rank's batch, or its share ceil(batch / N) of a fixed global one, and its chunk of every parameter,
ceil(rows / N), never grow with N); that holds for allocated memory but not always for reserved, which the caching
allocator's fragmentation moves either way: llama-3.1-70b, global batch 8, checkpoint:segments=all+fsdp:offload=cpu reserves 80,948 MiB a rank on 5
ranks and 88,868 on 6 (allocated within 1 MB of each other), so halving from 8 (fits) through 6 and 7 (do not)
would never try 5. Hence the last gap is scanned: on up to 8 ranks every count between the doubling's last two
is tried. The counts the search skipped are named, and the assumption is checked over the counts it tried
(`monotonic_check`): a candidate whose per-GPU memory grew with the ranks is named there. With an answer on N GPUs,
every count below N that was tried had none; a count skipped below N is one the assumption rules out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

from bench.analysis import plan, plan_search, pools
from bench.core.errors import UsageError
from bench.core.results import Status
from bench.core.schema import Row
from bench.run import eta
from strategies import StrategySpec
from strategies.framework.composite import members_of
from strategies.framework.sharding import data_parallel_replicas


SCANNED_GAP = 3  # counts between a count without an answer and one with: at most this many are all tried
# The most ranks `--max-ranks` searches up to. Each count is a search of its own, and where no count fits (a rank's
# batch over the limit on any number of GPUs) all of 1, 2, 4, ... up to the maximum are searched; a ZeRO-1
# candidate's prediction traces each of its ranks (its ranks hold different parameter partitions), so its time grows
# with the count: 128 ranks of a 4-layer MLP took 38 s on this 2-core machine, 10,000 would take about 50 minutes a
# candidate (the candidate in flight is not stopped by --max-search-s).
MAX_SEARCHED_RANKS = 1024


@dataclass
class RankCount:
    """One rank count's search: its rows (the candidates it ran), its answer and its smallest candidate."""

    ranks: int
    searched: plan_search.Searched
    answer: Row | None
    smallest: Row | None
    note: str = ""


def check_max_ranks(max_ranks: int) -> None:
    """`--max-ranks` up to MAX_SEARCHED_RANKS, or a UsageError naming the range (before anything is searched)."""
    if max_ranks > MAX_SEARCHED_RANKS:
        raise UsageError(f"--max-ranks {max_ranks:,} is more than plan searches: give 1 to {MAX_SEARCHED_RANKS:,} "
                         "(each rank count is a search of its own, and a ZeRO-1 candidate's prediction traces each of "
                         "its ranks, so the search would run for hours)")


def rank_counts(max_ranks: int, request: plan.PlanRequest) -> list[int]:
    """The rank counts that may be tried, in order: 1 to `max_ranks`, no more than a fixed global batch's samples."""
    return list(range(1, request.most_ranks(max_ranks) + 1))


def fewest_ranks(request: plan.PlanRequest, max_ranks: int, progress: Callable[[str], None] = lambda text: None,
                 executor: str = pools.LOCAL, ray_address: str | None = None,
                 on_count: Callable[[list, RankCount], None] = lambda counts, latest: None) -> list[RankCount]:
    """Each rank count's search, in the order above (doubling from one rank to the first count with an answer, then
    halving the gap below it down to SCANNED_GAP counts, which are tried fewest first), its candidates evaluated by
    `executor` (`plan_search.search`); the counts tried, by rank count. `on_count(counts, latest)` is called after
    each (the counts so far, by rank count, and the one just searched). `max_ranks` is at most MAX_SEARCHED_RANKS."""
    check_max_ranks(max_ranks)
    tried: dict[int, RankCount] = {}
    known: list[Row] = []
    top = rank_counts(max_ranks, request)[-1]
    started = time.monotonic()

    def answered(ranks: int) -> bool:
        nonlocal known
        left = counts_left(top, {count: found.answer is not None for count, found in tried.items()})
        progress(f"plan on {ranks} rank{'s' if ranks > 1 else ''} ("
                 f"{eta.left_text(left, len(tried), time.monotonic() - started, 'rank counts', at_most=True)}"
                 " with this one) ...")
        found, note = plan_search.search_where_cuda_runs(
            replace(request.on_ranks(ranks), sharded_only=ranks > 1, known_rows=[dict(row) for row in known],
                    feeds_ranks=ranks == 1 and top > 1),
            progress, executor, ray_address)
        answer = plan.decide(found.rows, request.allow_different)
        tried[ranks] = RankCount(ranks, found, answer, plan.smallest(found.rows), note)
        on_count(sorted(tried.values(), key=lambda c: c.ranks), tried[ranks])
        if ranks == 1:  # what the rank counts after it reuse: candidates that shard nothing, and the baseline
            known = [row for row in found.rows if row["status"] == Status.OK.value]
        return answer is not None

    searched_counts(top, answered)
    return sorted(tried.values(), key=lambda c: c.ranks)


def searched_counts(top: int, answered: Callable[[int], bool]) -> None:
    """The order of the rank counts up to `top` (`answered(ranks)`: whether that count has a plan that fits):
    doubling from one rank to the first count with an answer, then halving the gap below it down to SCANNED_GAP
    counts, which are tried fewest first."""
    below, above, ranks = 0, None, 1
    while above is None:
        if answered(ranks):
            above = ranks
        elif ranks == top:
            break
        else:
            below, ranks = ranks, min(top, ranks * 2)
    while above is not None and above - below - 1 > SCANNED_GAP:
        middle = (below + above) // 2
        below, above = (below, middle) if answered(middle) else (middle, above)
    for ranks in range(below + 1, above or below):  # the last gap, fewest first: no assumption needed there
        if answered(ranks):
            break


def counts_left(top: int, known: dict[int, bool]) -> int:
    """The most rank counts `searched_counts` may still try, given whether each count tried so far had an answer
    (`known`): its order run with every untried count below `top` answering no and `top` yes, the longest way on
    (doubling to the top, then every halving and the whole last gap). A progress line's bound only."""
    visited: list[int] = []

    def pessimist(ranks: int) -> bool:
        visited.append(ranks)
        return known[ranks] if ranks in known else ranks == top

    searched_counts(top, pessimist)
    return sum(1 for ranks in dict.fromkeys(visited) if ranks not in known)


def mesh_of(spec: str, ranks: int) -> str:
    """How a candidate lays out its ranks: `8 dp x 8 tp` (its tensor-parallel degree, the data-parallel replicas
    the rest of the ranks make), `64 dp x 1 tp` for a data-parallel strategy alone; `1 GPU` on one rank."""
    if ranks <= 1:
        return "1 GPU"
    strategy = StrategySpec(spec).build()
    degrees = {m.name: m.settings["degree"] for m in members_of(strategy) if m.name in ("tp", "cp")}
    return (f"{data_parallel_replicas(strategy, ranks)} dp x {degrees.get('tp', 1)} tp"
            + (f" x {degrees['cp']} cp" if "cp" in degrees else ""))


def fewest(counts: list[RankCount]) -> RankCount | None:
    """The count with the fewest ranks that has an answer (None: none has)."""
    return next((c for c in counts if c.answer is not None), None)


def skipped(counts: list[RankCount], max_ranks: int, request: plan.PlanRequest) -> list[int]:
    """The rank counts up to the answer (or to the largest allowed) that the search did not try."""
    answer = fewest(counts)
    last = answer.ranks if answer else rank_counts(max_ranks, request)[-1]
    done = {c.ranks for c in counts}
    return [n for n in range(1, last + 1) if n not in done]


def monotonic_check(counts: list[RankCount]) -> str:
    """Whether each candidate's judged per-GPU memory never grew with the rank count over the counts tried:
    'held over N candidates tried at several counts', or 'VIOLATED: ...' naming each growth."""
    by_spec: dict[str, list[tuple[int, int]]] = {}
    for count in counts:
        for row in count.searched.rows:
            if row["status"] == Status.OK.value and row["judged_bytes"] is not None:
                by_spec.setdefault(row["strategy"], []).append((count.ranks, row["judged_bytes"]))
    growths = [f"{spec} {a} -> {b} ranks grew by {jb - ja:,} B" for spec, seen in sorted(by_spec.items())
               for (a, ja), (b, jb) in zip(sorted(seen), sorted(seen)[1:]) if jb > ja]
    if growths:
        return "VIOLATED: " + "; ".join(growths)
    several = sum(1 for seen in by_spec.values() if len(seen) > 1)
    return f"held over the {several} candidates tried at several rank counts"
