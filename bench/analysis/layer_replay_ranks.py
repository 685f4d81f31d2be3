"""Layer replay of a sharded step: each rank's event log at N decoder layers built from its own traces at a few
layers, proven against one more real trace of that rank, and the rank with the largest peak chosen from those logs.

A sharded strategy (fsdp, ZeRO, DDP, tensor or context parallelism) runs one rank at a time in this process as that
rank of PyTorch's fake process group (`bench.analysis.fake_engine.tracked_step`); a rank's step is a decoder stack
like a one-rank step, with each layer's collectives and buffers inside its period. So each rank traced is replayed as
`bench.analysis.layer_replay` replays a one-rank step (the same traces, the same proof, the same template), with the
strategy bound and planned inside that rank's process group. Which ranks are traced is the full trace's rule: one of
each `rank_signature` (ranks that hold chunks and batch shares of the same sizes allocate the same; the signatures are
the same at every layer count, since every layer holds the same parameters). Of the replayed logs the largest
live-bytes peak is the row's, as `fake_engine._largest_rank` takes the largest traced peak. Where any rank's replay
is refused, the full trace runs, as for one rank.
"""

from __future__ import annotations

import re

from bench.analysis import layer_replay
from bench.measure.layer_template import NoReplay


# the sharded strategies whose ranks' logs make a template, tried at small size (Llama, 2 ranks, fake CUDA): fsdp with
# and without a mixed-precision policy did; ddp, zero1, zero2 and zero3 made none (their logs part at an event that
# repeats no period; zero3's three small traces alone took 70-110 s on the loaded machine), and tp refuses the small
# Llamas' tied embeddings. The others are traced in full without trying: a prediction never pays for a replay that is
# refused every time.
REPLAYED_SHARDINGS = frozenset({"fsdp"})


def unreplayed_shardings(strategy) -> list[str]:
    """The sharded members of `strategy` whose ranks are traced in full without trying (not in REPLAYED_SHARDINGS)."""
    return sorted({member.name for member in getattr(strategy, "members", [strategy])
                   if member.distributed and member.name not in REPLAYED_SHARDINGS})


def tracked_ranks_by_layers(case, spec: str, engine: str, warmup_steps: int | None,
                            capability: tuple[int, int] | None, ranks: int, strategy, prepare=None):
    """(the case's sharded step built by layer replay, rank by rank, or None, and why not); `strategy` is the
    case's strategy bound for `ranks` (its checkpoint plan says whether layers come in two kinds). The step is the
    largest rank's, with `rank` and `ranks_traced` set as the full trace sets them. `prepare(strategy, count, plain,
    repeated, rank)`, where given, returns the strategy each small trace of a rank runs (`layer_replay.tracer`'s,
    with the rank)."""
    from bench.analysis.fake_engine import TrackedStep, one_rank_of_each_signature

    unproven = unreplayed_shardings(strategy)
    if unproven:
        return None, (f"{', '.join(unproven)} ranks: only {', '.join(sorted(REPLAYED_SHARDINGS))} ranks are "
                      "replayed (the others' logs made no template at small size)")
    layers = layer_replay.layers_of_case(case)
    tried = (re.sub(r":seq_len=\d+", "", case.workload), spec, engine, ranks)
    if tried in _REFUSED:
        return None, f"{_REFUSED[tried]}, found on an earlier case of this model and strategy"
    kinds = layer_replay.layer_kinds(strategy, layers)
    try:
        # rank -> (its small steps, its log at `layers`, recompute plan, attention calls)
        replayed = one_rank_of_each_signature(
            ranks, lambda rank: layer_replay.replayed(
                layer_replay.tracer(case, spec, engine, warmup_steps, capability, ranks, rank,
                                    _for_rank(prepare, rank)), layers, kinds),
            lambda result: result[0][0].rank_signatures)
        if len({plan for _, _, plan, _ in replayed.values()}) > 1:
            raise NoReplay("recompute plans that differ by rank")
        peaks = {rank: layer_replay.live_peak(events) for rank, (_, events, _, _) in replayed.items()}
        largest = max(peaks, key=lambda rank: peaks[rank])  # the first of equal peaks, as the full trace takes it
        steps, events, plan, calls = replayed[largest]
        host = layer_replay.host_peak(steps, layers, kinds)
    except NoReplay as why:
        _REFUSED[tried] = str(why)
        return None, str(why)
    return TrackedStep(peaks[largest], events, engine, None, {}, steps[0].sdpa_kernel, calls, plan, host,
                       steps[0].rank_signatures, tuple(replayed), largest), None


def _for_rank(prepare, rank: int):
    """`prepare` (see `tracked_ranks_by_layers`) for `rank`'s traces, as `layer_replay.tracer` calls it; None for
    None."""
    if prepare is None:
        return None
    return lambda strategy, count, plain, repeated: prepare(strategy, count, plain, repeated, rank)


# why a sharded replay was refused, by (workload spec without its length, strategy spec, engine, ranks)
_REFUSED: dict[tuple, str] = {}

