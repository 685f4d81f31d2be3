"""The floor of a plan combination that keeps the baseline's training state: the bytes of the parameters and optimizer
state every such candidate holds, counted once on the meta device; a combination over the limit by them alone gets its
row at once, with no trace.

A strategy that says `keeps_training_state` holds the baseline's parameters and optimizer state on the device as the
baseline does (tests/test_plan_floor.py checks each one that says so); a combination keeps it when every member does.
From the end of its first optimizer step such a candidate holds at least those tensors, so its allocated peak is at
least the floor, its reserved peak at least that (a block is never smaller than its tensor), and its judged memory
(reserved plus the CUDA context) at least the floor plus the context. Where that is over the limit it cannot fit,
whatever its activations, and the search needs no figure of a combination that cannot fit (`plan.evaluate`'s
`may_stop`). A setting alone is traced as before where its ratios may make a combination that could fit: one with a
setting that does not keep the state (and that may combine: it keeps what is trained, or `--allow-different`; on
several ranks, or feeding them, any). Where none may, a setting alone that keeps the state is ruled out as well, and
with no figures it makes no combination (`plan_search`: a combination needs members that saved something).
"""

from __future__ import annotations

from bench.analysis import plan, plan_step
from bench.core.errors import Unsupported
from bench.core.schema import Row
from bench.core.units import format_size
from bench.run.training_state import training_state_bytes  # noqa: F401 - read here by plan_search (tests replace it)

# what a row stopped by the floor says after plan_step.STOPPED_OVER_LIMIT (the console counts them apart)
HOLDS_THE_BASELINES_STATE = "it holds the baseline's parameters and optimizer state"


def ratios_may_combine(request: plan.PlanRequest, settings: list[str]) -> bool:
    """Whether the ratios of a setting alone that keeps the baseline's training state may make a combination that
    could fit: where one of the search's `settings` (specs) does not keep it and may combine (it keeps what is
    trained, as far as binding it tells, or `--allow-different`), or on several ranks or feeding them (any)."""
    if request.allow_different or request.ranks > 1 or request.feeds_ranks:
        return True
    for spec in settings:
        strategy = plan.bind_for_plan(request.case(spec), request.ranks)[0]
        if not strategy.keeps_training_state and not strategy.differs_by_design():
            return True
    return False


def floor_row(request: plan.PlanRequest, spec: str, members: int, floor_bytes: int | None,
              alone_too: bool = False) -> Row | None:
    """The row of a combination (two members or more; with `alone_too` a setting alone too: `ratios_may_combine`
    said that its ratios make no combination that could fit) on CUDA that keeps the baseline's training state and
    cannot fit by it alone (`floor_bytes`, `training_state_bytes`, plus the CUDA context over the limit): no peak, no
    time, why; None for any other candidate, which is traced (one its check refuses too: its trace says why)."""
    if floor_bytes is None or members < (1 if alone_too else 2) or request.device != "cuda" \
            or floor_bytes + request.context_bytes <= request.limit_bytes:
        return None
    try:
        strategy, context = plan.bind_for_plan(request.case(spec), request.ranks)
        strategy.check(context)
    except Unsupported:
        return None
    if not strategy.keeps_training_state:
        return None
    judged = floor_bytes + request.context_bytes
    row = plan.empty_row(request, strategy.spec(), members)
    row.update(fits=False, differs_by_design=strategy.differs_by_design(),
               message=f"{plan_step.STOPPED_OVER_LIMIT}: {HOLDS_THE_BASELINES_STATE} ({format_size(floor_bytes)}, "
                       f"{floor_bytes:,} B, counted on the meta device), as each of its techniques does; with the CUDA "
                       f"context that is {judged:,} B, over the limit ({request.limit_bytes:,} B) whatever its "
                       "activations: not traced")
    return row


def stopped_by_floor(row: Row) -> bool:
    """Whether `row` is a combination the floor ruled out (`floor_row`)."""
    return plan_step.stopped_over_limit(row) and HOLDS_THE_BASELINES_STATE in row["message"]
