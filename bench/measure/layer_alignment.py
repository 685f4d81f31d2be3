"""The alignment of a decoder step's event logs at layer counts one apart: where one more layer adds its events (each
inserted block repeats the period before it) and each such site's whole run of periods (bench.measure.layer_template
makes a layer template of them)."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Sequence

from bench.measure.layer_identity import module_pattern
from bench.measure.memory import MemoryEvent

_MATCH_AHEAD = 8  # events after an inserted block that must match the smaller log again for the block to be taken


class NoReplay(Exception):
    """Why the logs do not make a layer template (the full trace runs instead)."""


# --- alignment of the logs at k and k+1 layers -------------------------------------------------------------------

def _shape(event: MemoryEvent, allocs: dict) -> tuple:
    """What an event is, without the numbers that change with the layers (its key, a layer index in its module);
    a free or category event also by what it names (its storage's bytes, stage and module), so that a stretch of
    such events is cut where they start to name storages of another kind."""
    named = allocs.get(event.key) if event.kind in ("free", "category") else None
    target = (named.nbytes, named.stage, module_pattern(named.module)) if named is not None else None
    return event.kind, event.nbytes, event.stage, event.op, module_pattern(event.module), event.category, target


def tokens(events: Sequence[MemoryEvent], codes: dict) -> list[int]:
    allocs = {event.key: event for event in events if event.kind == "alloc"}
    return [codes.setdefault(_shape(event, allocs), len(codes)) for event in events]


def align(smaller: list[int], larger: list[int]) -> list[tuple[int, int]]:
    """Where the larger log (one layer more) has events the smaller lacks: (position in the larger log, length) of
    each inserted block, in order; each block repeats the block just before it (one period of a run). NoReplay when
    the larger log is not the smaller one with such blocks inserted.

    At each event the logs part, the blocks tried are first those after which _MATCH_AHEAD events match the smaller
    log again, then those after which fewer do (two sites a few events apart: a sharded step frees each layer's
    reduce-scattered gradients just after the optimizer's per-parameter temporaries); a choice that leads to no
    alignment further on is undone and the next tried (a point reached once and failed is not walked again)."""
    failed: set[tuple[int, int]] = set()
    stuck = [0]  # the furthest event of the larger log at which no block fitted, for the message

    at: dict[int, list[int]] = {}  # each token's positions in the larger log, in order
    for position, token in enumerate(larger):
        at.setdefault(token, []).append(position)

    def blocks(i: int, j: int):
        ahead = smaller[i:i + _MATCH_AHEAD]
        # a block of `length` that repeats the one before starts with the token `length` events back: only those
        # lengths are compared whole (comparing every length was most of making a QLoRA template)
        before = at[larger[j]][:bisect_left(at[larger[j]], j)]
        repeating = [length for length in (j - position for position in reversed(before))
                     if length <= len(larger) - j and larger[j + length - 1] == larger[j - 1]
                     and larger[j:j + length] == larger[j - length:j]]
        full = [length for length in repeating if larger[j + length:j + length + len(ahead)] == ahead]
        return full + [length for length in repeating if length not in full
                       and j + length < len(larger) and larger[j + length] == smaller[i]]

    def from_(i: int, j: int) -> list[tuple[int, int]] | None:
        while i < len(smaller) and j < len(larger) and smaller[i] == larger[j]:
            i, j = i + 1, j + 1
        if i == len(smaller):
            length = len(larger) - j
            return [] if length == 0 else [(j, length)] if larger[j:] == larger[j - length:j] else None
        if j >= len(larger) or (i, j) in failed:
            return None
        for length in blocks(i, j):
            rest = from_(i, j + length)
            if rest is not None:
                return [(j, length)] + rest
        failed.add((i, j))
        stuck[0] = max(stuck[0], j)
        return None

    sites = from_(0, 0)
    if sites is None:
        raise NoReplay(f"event {stuck[0]} of the larger log repeats no period before it")
    return sites



# --- runs of periods ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    """A run of periods in a template's reference log: `periods` blocks of `length` events from `start`; per kind of
    layer (one kind, or checkpointed and plain), how many periods one more layer of that kind adds (`growth`)."""

    start: int
    length: int
    periods: int
    growth: tuple[int, ...]


def runs_of(tokens: list[int], sites: list[tuple[int, int]]) -> list[Run]:
    """Each site's whole run in the larger log: its inserted block extended backwards and forwards by the periods
    of the same events around it."""
    runs: list[Run] = []
    for position, length in sites:
        block = tokens[position:position + length]
        start = position
        while start - length >= 0 and tokens[start - length:start] == block:
            start -= length
        end = position + length
        while tokens[end:end + length] == block:
            end += length
        if runs and start < runs[-1].start + runs[-1].length * runs[-1].periods:
            raise NoReplay("two sites' runs overlap")
        runs.append(Run(start, length, (end - start) // length, (1,)))
    return runs


def kinds_runs(base: list[int], larger: Sequence[list[int]]) -> list[Run]:
    """The runs of the base log, where `larger[kind]` is the log of one more layer of that kind: each larger log's
    runs less the period it inserted, at their places in the base log; a run both kinds lengthen (the optimizer's
    over every layer) grows by one period with a layer of either. NoReplay where a kind adds no event or two kinds'
    runs overlap without being the same."""
    found: dict[tuple[int, int, int], list[int]] = {}
    for kind, tokens in enumerate(larger):
        sites = align(base, tokens)
        if not sites:
            raise NoReplay(f"one more layer of kind {kind} adds no event")
        inserted = 0  # events the larger log inserted before this run
        for (_, length), run in zip(sites, runs_of(tokens, sites)):
            growth = found.setdefault((run.start - inserted, run.length, run.periods - 1), [0] * len(larger))
            growth[kind] += 1
            inserted += length
    runs = [Run(start, length, periods, tuple(growth)) for (start, length, periods), growth in sorted(found.items())]
    for index in range(len(runs) - 1):
        before, after = runs[index], runs[index + 1]
        overlap = before.start + before.length * before.periods - after.start
        if overlap > 0:  # a checkpointed layer's period ends with the events a plain one's starts with: one is turned
            runs[index], runs[index + 1] = _turned_apart(base, before, after, overlap)
    for before, after in zip(runs, runs[1:]):
        if after.start < before.start + before.length * before.periods:
            raise NoReplay("runs of two kinds of layers overlap")
    return runs


def _turned_apart(tokens: list[int], before: Run, after: Run, overlap: int) -> tuple[Run, Run]:
    """Two runs whose periods share `overlap` events where they meet, made to meet without: the later one's periods
    start `overlap` events on, or the earlier one's that many before, where the events there repeat (the alignment
    cut each kind's periods where its own logs first differed); else one of them a period shorter where they meet,
    the rest of that period fixed events (an FSDP rank's layers end and begin with the same gathers)."""
    end = after.start + after.length * after.periods
    if overlap < after.length and tokens[end:end + overlap] == tokens[after.start:after.start + overlap]:
        return before, Run(after.start + overlap, after.length, after.periods, after.growth)
    start, end = before.start - overlap, before.start + before.length * before.periods
    if overlap < before.length and start >= 0 and tokens[start:before.start] == tokens[end - overlap:end]:
        return Run(start, before.length, before.periods, before.growth), after
    if overlap <= before.length and before.periods > 1:
        return Run(before.start, before.length, before.periods - 1, before.growth), after
    if overlap <= after.length and after.periods > 1:
        return before, Run(after.start + after.length, after.length, after.periods - 1, after.growth)
    raise NoReplay("runs of two kinds of layers overlap")
