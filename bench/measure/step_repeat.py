"""Step repeat: the event log of a steady-state step built from the log of the step before it, instead of running it.

A training step after the first allocates what the step before it allocated, in the same order, and frees the same:
its own temporaries, and what the step before it left for it (the gradients a `zero_grad` frees, the output it
replaces). So the measured step's log is the last warm-up step's, its storages renumbered as the tracker numbers them
(each "alloc" takes the next key), and each storage the warm-up step freed of the step before it stands, in the
repeat, for the one the warm-up step itself left live: paired in the order they were allocated, which must give each
pair the same bytes (`NotSteady` otherwise). Storages older than both steps (weights, optimizer state) keep their keys.

This holds only where the warm-up step runs as the measured one does: its breakdown prepared before it as well
(`bench.run.passes`' `steady_warmup`), so that its categories are the measured step's. Nothing here proves that a
step is steady: bench.analysis.layer_replay builds its template from repeated steps and proves the log it makes
against a trace whose every step ran.
"""

from __future__ import annotations

from typing import Callable, Sequence


class NotSteady(Exception):
    """A step that frees of the step before it other than what it leaves for the next: it cannot be repeated."""


def repeated_step(events: Sequence, start: int, end: int, next_key: int) -> list:
    """The log of the step after the one logged at `events[start:end]` (bench.measure.memory's MemoryEvents), its
    first new storage numbered `next_key`; NotSteady where what the step freed of the step before it does not pair,
    byte for byte, with what it left."""
    step = events[start:end]
    made = [event.key for event in step if event.kind == "alloc"]
    made_here = set(made)
    freed = {event.key for event in step if event.kind == "free"}
    left = [key for key in made if key not in freed]
    taken = sorted(key for key in freed if key not in made_here)
    sizes = {event.key: event.nbytes for event in events[:end] if event.kind == "alloc"}
    if [sizes.get(key) for key in taken] != [sizes[key] for key in left]:
        raise NotSteady("a step that frees of the step before it other than what it leaves for the next")
    renumbered = {key: next_key + index for index, key in enumerate(made)}
    key_of = {**dict(zip(taken, left)), **renumbered}
    return [event._replace(key=key_of.get(event.key, event.key)) if event.key else event for event in step]


def log_peak(events: Sequence, live: dict[int, tuple[int, str]] | None = None,
             storage_bytes: Callable[[int], int] | None = None) -> tuple[int, str, dict[str, int]]:
    """(peak bytes, its stage, bytes by category at the peak) of a tracker's log counted event by event from the
    storages `live` at its start (key: (bytes, category); none by default), a "reset" restarting the peak from what
    is live then (so: the peak of the log's last window); each storage counts as `storage_bytes(nbytes)`, exact by
    default. A storage's category is its "alloc"'s, or the last "category" event's (one may come before the alloc,
    as bench.measure.breakdown.CategorizedTracker logs it)."""
    live = dict(live or {})
    by_category: dict[str, int] = {}
    for nbytes, category in live.values():
        by_category[category] = by_category.get(category, 0) + nbytes
    total = peak = sum(by_category.values())
    peak_stage, peak_by_category = "setup", dict(by_category)
    filed_first: dict[int, str] = {}
    for event in events:
        kind = event.kind
        if kind == "alloc":
            nbytes = storage_bytes(event.nbytes) if storage_bytes else event.nbytes
            category = filed_first.pop(event.key, event.category)
            live[event.key] = (nbytes, category)
            by_category[category] = by_category.get(category, 0) + nbytes
            total += nbytes
        elif kind == "free":
            if event.key not in live:
                continue
            nbytes, category = live.pop(event.key)
            by_category[category] -= nbytes
            total -= nbytes
            continue
        elif kind == "category":
            if event.key in live:
                nbytes, old = live[event.key]
                by_category[old] -= nbytes
                by_category[event.op] = by_category.get(event.op, 0) + nbytes
                live[event.key] = (nbytes, event.op)
            else:
                filed_first[event.key] = event.op
            continue
        elif kind == "reset":
            peak = -1  # the window starts here: what is live now is its first figure
        else:
            continue
        if total > peak:
            peak, peak_stage, peak_by_category = total, event.stage, dict(by_category)
    return peak, peak_stage, peak_by_category
