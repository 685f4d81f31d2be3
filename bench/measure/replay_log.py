"""A traced step's event log as layer replay reads it: its measured window (`measured_log`, each run of frees in the
order of their storages' keys) and its live-bytes peak (`live_peak`)."""

from __future__ import annotations

import itertools
import operator

from bench.measure.cuda_allocator import CUBLAS_OPS
from bench.measure.layer_alignment import NoReplay
from bench.measure.memory import MemoryEvent
from bench.measure.step_repeat import log_peak


def measured_log(events: list[MemoryEvent]) -> list[MemoryEvent]:
    """A step's log up to the end of its measured window (its "end" event), each run of consecutive frees in the
    order of their storages' keys (`frees_in_key_order`). What follows the window are the frees of the session's
    teardown, in an order the garbage collector chooses, which move no figure of the replay (no storage is allocated
    there and no matrix product runs: checked, NoReplay otherwise)."""
    ends = [index for index, event in enumerate(events) if event.kind == "end"]
    if len(ends) != 1:
        raise NoReplay("a log without one end of its measured window")
    for event in events[ends[0] + 1:]:
        if event.kind == "alloc" or (event.kind == "op" and event.op.split(".")[0] in CUBLAS_OPS):
            raise NoReplay("a storage allocated or a matrix product run after the measured window")
    return frees_in_key_order(events[:ends[0] + 1])


def frees_in_key_order(events: list[MemoryEvent]) -> list[MemoryEvent]:
    """`events` with each run of consecutive "free" events sorted by storage key (the order the tracker allocated
    them). Such a run's order moves no figure: no byte is allocated or counted between its frees, and the caching
    allocator's model ends a run with the same blocks whatever its order (a freed block merges with its free
    neighbours, and the pools are ordered by size and address). Some runs come in an order no layer count predicts:
    autocast's cache of casts, freed when the forward leaves autocast, in the order of a hash table of tensors."""
    out: list[MemoryEvent] = []
    for frees, group in itertools.groupby(events, key=lambda event: event.kind == "free"):
        out += sorted(group, key=operator.attrgetter("key")) if frees else group
    return out


def live_peak(events: list[MemoryEvent]) -> int:
    """The most bytes live at once after the log's last peak reset, counted event by event (`step_repeat.log_peak`)."""
    return log_peak(events)[0]
