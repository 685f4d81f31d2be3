"""How many GPUs: the fewest ranks on which some plan fits, with that plan and each rank count's best (`plan
--max-ranks N`).

The rank counts are tried from one up: one rank is the ordinary plan (`plan_search.search`); at two ranks and more
only candidates with a sharded member run (ddp, zero1, fsdp, with the other techniques), each rank's step predicted in
one process (PyTorch's fake process group), since a candidate that shards nothing needs on N GPUs what it needs on
one: those rows come from the one-rank search, which the later searches also combine from. The first rank count with
an answer ends the search: the answer is the fewest GPUs. `--batch-size` is the global batch, split across the ranks,
so no more ranks than samples are tried.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from bench.analysis import plan, plan_search, pools
from bench.core.results import Status
from bench.core.schema import Row


@dataclass
class RankCount:
    """One rank count's search: its rows (the candidates it ran), its answer and its smallest candidate."""

    ranks: int
    searched: plan_search.Searched
    answer: Row | None
    smallest: Row | None
    note: str = ""


def rank_counts(max_ranks: int, batch_size: int) -> list[int]:
    """The rank counts tried, in order: 1 to `max_ranks`, no more than the global batch's samples."""
    return list(range(1, min(max_ranks, batch_size) + 1))


def fewest_ranks(request: plan.PlanRequest, max_ranks: int, progress: Callable[[str], None] = lambda text: None,
                 executor: str = pools.LOCAL, ray_address: str | None = None,
                 on_count: Callable[[list], None] = lambda counts: None) -> list[RankCount]:
    """Each rank count's search, from one rank up to the first with an answer (or `max_ranks`), its candidates
    evaluated by `executor` (`plan_search.search`); `on_count(counts)` is called after each (the counts so far)."""
    counts: list[RankCount] = []
    known: list[Row] = []
    for ranks in rank_counts(max_ranks, request.batch_size):
        progress(f"plan on {ranks} rank{'s' if ranks > 1 else ''} ...")
        found, note = plan_search.search_where_cuda_runs(
            replace(request, ranks=ranks, sharded_only=ranks > 1, known_rows=[dict(row) for row in known]), progress,
            executor, ray_address)
        answer = plan.decide(found.rows, request.allow_different)
        counts.append(RankCount(ranks, found, answer, plan.smallest(found.rows), note))
        on_count(counts)
        if answer is not None:
            break
        if ranks == 1:  # what the rank counts after it reuse: candidates that shard nothing, and the baseline
            known = [row for row in found.rows if row["status"] == Status.OK.value]
    return counts
