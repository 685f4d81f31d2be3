"""A plan candidate by layer replay (`bench.analysis.plan.evaluate`): its memory from the N-layer event log that
`bench.analysis.layer_replay` builds from a few small traces (of a sharded step, each rank's:
`bench.analysis.layer_replay_ranks`), its time from the operator totals of the same traces, extrapolated affinely in
the layer counts and proven on the last trace; and the probe that lets a candidate which may stop run its full-size
forward, or its whole first warm-up step, first.

`request` is the plan's `PlanRequest` (its ranks and `gpus_per_node` are read).
"""

from __future__ import annotations

import math
import re

from bench.analysis import layer_replay, layer_replay_ranks, plan_cost, plan_step
from bench.core.errors import Unsupported
from bench.measure.op_cost import step_totals
from bench.run.case import Case

# the integer totals of a step's operators (`step_totals`) and the row's columns they fill
_TOTAL_COLUMNS = {"flops": "step_flops", "bytes": "step_moved_bytes", "transfer_bytes": "host_transfer_bytes",
                  "collective_bytes": "step_collective_bytes", "ops": "step_ops"}
# how close an extrapolated estimate (in seconds) must come to the proof trace's own: sums of floats in another order
SECONDS_RELATIVE_TOLERANCE = 1e-9
# why layer replay of a model and strategy was refused (its log or its operator totals), by (workload spec without
# its length, strategy spec, engine, ranks): a later candidate of them is traced in full without trying again
REPLAY_REFUSED: dict[tuple, str] = {}


def replayed_candidate(case: Case, spec: str, engine: str, planned, request,
                        figures: plan_cost.DeviceFigures, warmup: int | None, notes: list[str]):
    """(the candidate's step built by layer replay, its time columns) where layer replay applies as it does for
    `predict` (`layer_replay.why_not_replayable`: one rank, or fsdp's ranks by `layer_replay_ranks`) and both its
    event log and its operator totals are proven; else None, and where it applied but was refused, why, in `notes`.

    The small traces (`layer_replay.tracked_step_by_layers`; of a sharded step, each rank's) each count their
    measured step's operators; a total of the N-layer step (of a sharded one, its largest rank's, as the full trace
    times it) is the affine function of the layer counts through the traces but the last (`_affine_at`), used only
    where the same function gives the last trace's own totals: integers exactly, the compute and communication
    seconds within SECONDS_RELATIVE_TOLERANCE. No trace stops early (`may_stop`): each holds a few layers, and the
    candidate gets all its figures."""
    if warmup is None or layer_replay.why_not_replayable(case, planned, _stepping_ranks(planned, request), engine,
                                                         snapshot=False):
        return None
    tried = _replay_key(case, spec, engine, request)
    if tried in REPLAY_REFUSED:
        notes.append(f"layer replay refused ({REPLAY_REFUSED[tried]}, found on an earlier candidate of this model "
                     "and strategy): every layer traced")
        return None
    counters: dict[int | None, dict[tuple[int, int], plan_step.MeasuredStepCounter]] = {}

    def counted_trace(strategy, count: int, plain: int | None, repeated: bool, rank: int | None = None):
        counter = counters.setdefault(rank, {})[(count, plain or 0)] = plan_step.MeasuredStepCounter(repeated)
        return plan_step.counted(strategy, counter, warmup - 1 if repeated else warmup)

    if planned.distributed:
        step, why = layer_replay_ranks.tracked_ranks_by_layers(case, spec, engine, warmup, None, request.ranks,
                                                               planned, prepare=counted_trace)
    else:
        step, why = layer_replay.tracked_step_by_layers(case, spec, engine, warmup, None, prepare=counted_trace)
    if step is None:
        REPLAY_REFUSED[tried] = why
        notes.append(f"layer replay refused ({why}): every layer traced")
        return None
    layers = layer_replay.layers_of_case(case)
    kinds = layer_replay.layer_kinds(planned, layers)
    try:
        columns = _extrapolated_time(counters[step.rank], kinds or (layers, 0), figures, request.gpus_per_node,
                                     warmup)
    except Unsupported as refused:  # the device lacks a dtype's arithmetic: the full trace's row says so
        notes.append(f"layer replay not used ({refused}): every layer traced")
        return None
    except _NotAffine as refused:
        REPLAY_REFUSED[tried] = str(refused)
        notes.append(f"layer replay refused ({refused}): every layer traced")
        return None
    notes.append(layer_replay.replay_note(layers, kinds) + "; its operator totals and time extrapolated from the "
                 "same traces (equal to the last one's)")
    return step, columns


def _replay_key(case: Case, spec: str, engine: str, request) -> tuple:
    return re.sub(r":seq_len=\d+", "", case.workload), spec, engine, request.ranks


def _stepping_ranks(planned, request) -> int:
    """The ranks whose steps a candidate traces: a strategy that shards nothing runs one process's step whatever
    `--ranks` says (its row is the same on every rank count)."""
    return request.ranks if planned.distributed else 1


def replay_applies(case: Case, spec: str, engine: str, planned, request, warmup: int | None) -> bool:
    """Whether `replayed_candidate` will trace the small steps (not whether it will be proven)."""
    return (warmup is not None and _replay_key(case, spec, engine, request) not in REPLAY_REFUSED
            and layer_replay.why_not_replayable(case, planned, _stepping_ranks(planned, request), engine,
                                                snapshot=False) is None
            and not (planned.distributed and layer_replay_ranks.unreplayed_shardings(planned)))


class ProbePassed(Exception):
    """A candidate's full-size step got under the limit as far as its probe looks (`FullSizeProbe`)."""


class FullSizeProbe(plan_step.ReservedCheck):
    """The check of a candidate that may stop and that layer replay can predict: it looks as `ReservedCheck` does
    (stopping the candidate once over the limit), and gives up (`ProbePassed`, raised where the check looks, between
    operators) once the first warm-up step's forward is over, or with `through_first_step` once that whole step is
    (`probes_first_step` says which costs less): past it the replay costs less than the rest of the full-size step
    (Llama-3.1-70B on one H100 at 4096 tokens stops before its first forward, in 0.3 s of CPU where its replay takes
    3.3)."""

    def __init__(self, limit_bytes: int, context_bytes: int, capability: tuple[int, int] | None,
                 through_first_step: bool = False):
        super().__init__(limit_bytes, context_bytes, capability)
        self.through_first_step = through_first_step

    def look(self, step: int, when: str, always: bool = False) -> None:
        super().look(step, when, always)
        if (when == plan_step.END) if self.through_first_step else (when != plan_step.FORWARD):
            raise ProbePassed()


# the share of a training step that its backward and optimizer step take, in traced operators (a checkpointed
# layer's backward runs its forward again)
AFTER_FORWARD_SHARE = 2 / 3


def probes_first_step(case: Case, planned, warmup: int) -> bool:
    """Whether a candidate that may stop is probed through its whole first warm-up step at full size, not only its
    forward: where the rest of that step (its backward and optimizer step over every layer) holds fewer traced
    layer-steps than the replay's small traces (their layers times the steps each runs: the proof's every step,
    the others' warm-up steps), since the search probes only candidates whose members do not promise that they fit,
    and most of those that get past their forward go over the limit in their backward or optimizer step, where they
    stop instead of being replayed. A decoder of 32 layers is probed through its first step (21 layer-steps after
    its forward against the replay's 29: llama-3.1-8b at 4096 tokens on an H100, where each of the 11 combinations
    of the search's first 40 that passed their forward stopped at the end of that step), one of 80 is not (53)."""
    layers = layer_replay.layers_of_case(case)
    return AFTER_FORWARD_SHARE * layers < layer_replay.traced_layer_steps(layer_replay.layer_kinds(planned, layers),
                                                                          warmup)


class _NotAffine(Exception):
    """The operator totals of the small traces are not one affine function of their layer counts."""


def _affine_at(values: dict[tuple[int, int], float], at: tuple[int, int]) -> float:
    """The affine function of the (checkpointed or only, plain) layer counts through `values` at `at`: the traces
    differ from the first by one layer of one kind each (`layer_replay.kinds_traced`), which gives its slopes."""
    (base, first), *others = values.items()
    value = first
    for (count, plain), other in others:
        if (count - base[0], plain - base[1]) not in ((1, 0), (0, 1)):
            raise _NotAffine(f"traces at {base} and {(count, plain)} layers, not one layer apart")
        value += (other - first) * ((at[0] - base[0]) if count != base[0] else (at[1] - base[1]))
    return value


def _trace_totals(ops, figures: plan_cost.DeviceFigures, gpus_per_node: int) -> dict:
    """A step's integer totals (`step_totals`) and its compute and communication seconds."""
    return {**step_totals(ops), "compute_s": figures.compute_seconds(ops),
            "communication_s": figures.communication_seconds(ops, gpus_per_node)}


def _extrapolated_time(counters: dict, layers: tuple[int, int], figures: plan_cost.DeviceFigures,
                       gpus_per_node: int, warmup: int) -> dict:
    """The time columns of the step at `layers` (checkpointed or only, plain) from the operators counted in the
    small traces (`counters` by their layer counts, in the order they ran, the proof last); _NotAffine where the
    proof's totals are not those its layer counts give."""
    if any(len(counter.steps) != warmup + 1 - counter.repeats_last_warmup for counter in counters.values()):
        raise _NotAffine("a trace whose operator counter saw another number of steps")
    totals = {at: _trace_totals(counter.steps[-1], figures, gpus_per_node) for at, counter in counters.items()}
    *fitted, proof = totals
    for name, proven in totals[proof].items():
        made = _affine_at({at: totals[at][name] for at in fitted}, proof)
        if not (made == proven if isinstance(proven, int)
                else math.isclose(made, proven, rel_tol=SECONDS_RELATIVE_TOLERANCE, abs_tol=0.0)):
            raise _NotAffine(f"the operators' {name} made for {proof[0]}+{proof[1]} layers, {made}, differ from "
                             f"their trace's, {proven}")
    at_layers = {name: _affine_at({at: totals[at][name] for at in fitted}, layers) for name in totals[proof]}
    if not at_layers["ops"]:
        raise _NotAffine("no operator of its step was counted")
    columns = {column: at_layers[name] for name, column in _TOTAL_COLUMNS.items()}
    communication_s = at_layers["communication_s"]
    columns.update(est_step_time_ms=(at_layers["compute_s"] + communication_s) * 1e3,
                   est_comm_time_ms=communication_s * 1e3,
                   time_estimator=f"{plan_cost.ESTIMATOR}; {figures.name}: {figures.source}")
    return columns
