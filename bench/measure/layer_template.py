"""The layer template: the event log of a step of an N-layer decoder stack built from its logs at k and k+1 layers
(bench.analysis.layer_replay traces them and proves the result before it is trusted).

A homogeneous stack's step repeats the same events once per layer in each of its stretches (the parameters' setup,
each step's forward and backward, each of the optimizer's per-parameter operators). Aligning the log at k layers with
the log at k+1 finds where one layer adds its events (`align`): at each such site a block that repeats the period
before it. Each event is then named by where it sits in the log's template: a fixed event of the k+1 log, or
(site, period, offset) in a site's run of periods. Every number in an event that changes with the layers (the storage
an event frees or files, the layer index in its module's name) is an affine function of the period and the layer
count, fitted exactly per template slot on the two logs (`LayerTemplate`); the log at N layers is the template with
each run extended to its N-layer length and those numbers evaluated there (`LayerTemplate.events`), with fresh
storage keys in the order allocated, as the tracker numbers them.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

from bench.measure.exact_affine import NotWhole, evaluate as _evaluate, solve as _solve
from bench.measure.layer_identity import (MODULE_INDEX as _MODULE_INDEX, alloc_shape as _alloc_shape, by_layer_model,
                                          identities)
from bench.measure.memory import MemoryEvent

_MATCH_AHEAD = 8  # events after an inserted block that must match the smaller log again for the block to be taken


# the periods fitted apart, tried in turn; a storage named by what it is and its layer only where no slot fits it
_FITS = [(edges, by_layer) for by_layer in (False, True) for edges in ((), ("first",), ("last",), ("first", "last"))]


class NoReplay(Exception):
    """Why the logs do not make a layer template (the full trace runs instead)."""


# --- alignment of the logs at k and k+1 layers -------------------------------------------------------------------

def _shape(event: MemoryEvent, allocs: dict) -> tuple:
    """What an event is, without the numbers that change with the layers (its key, a layer index in its module);
    a free or category event also by what it names (its storage's bytes, stage and module), so that a stretch of
    such events is cut where they start to name storages of another kind."""
    named = allocs.get(event.key) if event.kind in ("free", "category") else None
    target = (named.nbytes, named.stage, _MODULE_INDEX.sub("#", named.module)) if named is not None else None
    return event.kind, event.nbytes, event.stage, event.op, _MODULE_INDEX.sub("#", event.module), event.category, target


def _tokens(events: Sequence[MemoryEvent], codes: dict) -> list[int]:
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


# --- the template ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Run:
    """One site's run of periods in the larger log: `periods` blocks of `length` events from `start`; the block the
    larger log inserted is period `inserted`."""

    start: int
    length: int
    periods: int
    inserted: int


def _runs(tokens: list[int], sites: list[tuple[int, int]]) -> list[_Run]:
    """Each site's whole run in the larger log: its inserted block extended backwards and forwards by the periods
    of the same events around it."""
    runs = []
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
        runs.append(_Run(start, length, (end - start) // length, (position - start) // length))
    return runs


class LayerTemplate:
    """The log of a step at any layer count, made from its logs at `layers` and `layers + 1` (see the module)."""

    def __init__(self, smaller: Sequence[MemoryEvent], larger: Sequence[MemoryEvent], layers: int):
        try:
            self._make(smaller, larger, layers)
        except NotWhole as error:
            raise NoReplay(str(error)) from None

    def _make(self, smaller: Sequence[MemoryEvent], larger: Sequence[MemoryEvent], layers: int) -> None:
        self.layers = layers
        codes: dict = {}
        small_tokens, large_tokens = _tokens(smaller, codes), _tokens(larger, codes)
        sites = align(small_tokens, large_tokens)
        if not sites:
            raise NoReplay("one more layer adds no event")
        self.larger = list(larger)
        self.runs = _runs(large_tokens, sites)
        # each event of the larger log: its slot (a template position: a fixed event's, or a run's offset) and period
        self._slot_of, self._period_of = self._places()
        small_places = self._smaller_places(len(smaller), sites)
        self._fit(((smaller, small_places, layers), (larger, list(zip(self._slot_of, self._period_of)), layers + 1)))
        self._programs: dict[tuple, tuple] = {}  # (slot, edge) -> what `_emit` needs (`_program`)
        self._by_layer = any(model[1] == "identity" for _, models in self._models.values() for model in models.values())

    def _places(self) -> tuple[list[tuple], list[int]]:
        """The slot and period of each event of the larger log (a fixed event: its position, period 0)."""
        slots: list[tuple] = [("fixed", position) for position in range(len(self.larger))]
        periods = [0] * len(self.larger)
        for index, run in enumerate(self.runs):
            for offset in range(run.length * run.periods):
                slots[run.start + offset] = ("run", index, offset % run.length)
                periods[run.start + offset] = offset // run.length
        return slots, periods

    def _smaller_places(self, count: int, sites: list[tuple[int, int]]) -> list[tuple[tuple, int]]:
        """The slot and period of each event of the smaller log: the larger log's event it aligns with, one period
        less after the inserted block of its run."""
        places = []
        inserted = iter(sites)
        position, length = next(inserted, (None, 0))
        j = 0
        for _ in range(count):
            while position is not None and j == position:
                j += length
                position, length = next(inserted, (None, 0))
            slot, period = self._slot_of[j], self._period_of[j]
            if slot[0] == "run" and period > self.runs[slot[1]].inserted:
                period -= 1
            places.append((slot, period))
            j += 1
        return places

    def _fit(self, logs) -> None:
        """Per slot and quantity (the storage a free or category event names; each number in its module's name):
        a model of it by the period and the layer count. A run's first or last period may differ from the others
        (the first layer's backward, a category event filed before the next period's alloc): where one model does
        not fit a quantity in every period, those periods get their own. A storage in a run is named by layer where
        both runs' periods have layer indices (the same layer, the one before), else by an affine function, else (a
        run naming storages of checkpointed and of plain layers) by what it is and its layer (`layer_identity`)."""
        observed: dict[tuple, list] = {}
        for events, places, layers in logs:
            named = identities(events)
            # a "category" event may come just before its storage's alloc (`breakdown.CategorizedTracker`)
            alloc_place = {event.key: place for event, place in zip(events, places) if event.kind == "alloc"}
            for event, (slot, period) in zip(events, places):
                quantities: dict = {}
                if event.kind in ("free", "category"):
                    found = alloc_place.get(event.key)
                    # a storage the log never allocated is named as is
                    quantities["target"] = (("key", event.key, None) if found is None
                                              else (found[0], found[1], named[event.key]))
                for place, number in enumerate(_MODULE_INDEX.findall(event.module)):
                    quantities["index", place] = number
                edge = self._edge(slot, period, layers)
                for name, value in quantities.items():
                    observed.setdefault((slot, name), []).append((edge, period, layers, value))
        self._models: dict[tuple, tuple[tuple[str, ...], dict]] = {}
        self._layer_of_run: dict[int, tuple] = {}
        numbers = [item for item in observed.items() if item[0][1] != "target"]
        storages = [item for item in observed.items() if item[0][1] == "target"]
        for items in (numbers, storages):
            if items is storages:  # a storage is named by layer: the runs' layer indices first
                self._layer_of_run = self._run_layers()
            for (slot, name), observations in items:
                for edges, by_layer in _FITS:
                    models = self._fit_groups(slot, name, observations, edges, by_layer)
                    if models is not None:
                        self._models[slot, name] = edges, models
                        break
                else:
                    raise NoReplay(f"no model of the period and layers fits the {name} of {slot}")

    def _run_layers(self) -> dict[int, tuple]:
        """Per run whose periods carry a layer index: the affine function of (period, layers) that gives it (the
        first number in the module name of its first slot that has one)."""
        found = {}
        for (slot, name), (edges, models) in self._models.items():
            if slot[0] == "run" and name == ("index", 0) and not edges and models["middle"][1] != 0:
                if slot[1] not in found or slot[2] < found[slot[1]][0]:
                    found[slot[1]] = slot[2], models["middle"]
        return {run: coefficients for run, (_, coefficients) in found.items()}

    def _fit_groups(self, slot: tuple, name, observations: list, edges: tuple[str, ...], by_layer: bool) -> dict | None:
        """{group: model} for one quantity of a slot, its observations grouped by their edge ("first" and "last"
        apart where `edges` names them, the rest "middle"); None where a group fits no model. A number's model is
        its affine coefficients; a named storage's is (target slot, "layer", layer offset) or (target slot, "affine",
        coefficients)."""
        groups: dict[str, list] = {}
        for edge, period, layers, value in observations:
            groups.setdefault(edge if edge in edges else "middle", []).append((period, layers, value))
        models = {}
        for group, members in groups.items():
            if name != "target":
                models[group] = _solve([(period, layers, int(value)) for period, layers, value in members])
            else:
                targets = {value[:2] if value[0] == "key" else value[0] for _, _, value in members}
                if len(targets) > 1:
                    models[group] = by_layer_model(members) if by_layer else None
                    if models[group] is None:
                        return None
                    continue
                target = targets.pop()
                models[group] = (target, "key", None) if target[0] == "key" else self._target_model(slot, target,
                                                                                                    members)
            if models[group] is None:
                return None
        return models

    def _target_model(self, slot: tuple, target: tuple, members: list) -> tuple | None:
        """How a slot names its storage's period in `target`: by layer offset from its own period's layer where
        both are runs with layer indices and one offset fits every observation, else by an affine function."""
        source_layer, target_layer = self._layer_of_run.get(slot[1]) if slot[0] == "run" else None, None
        if target[0] == "run":
            target_layer = self._layer_of_run.get(target[1])
        if source_layer is not None and target_layer is not None:
            offsets = {_evaluate(target_layer, value[1], layers) - _evaluate(source_layer, period, layers)
                       for period, layers, value in members}
            if len(offsets) == 1:
                return target, "layer", offsets.pop()
        coefficients = _solve([(period, layers, value[1]) for period, layers, value in members])
        return None if coefficients is None else (target, "affine", coefficients)

    def _edge(self, slot: tuple, period: int, layers: int) -> str:
        """Where `period` sits in its run at `layers` layers: "first", "last" or "middle" (a fixed event: "middle")."""
        if slot[0] != "run":
            return "middle"
        periods = self.runs[slot[1]].periods + layers - self.layers - 1
        return "first" if period == 0 else "last" if period == periods - 1 else "middle"

    def events(self, layers: int) -> list[MemoryEvent]:
        """The step's log at `layers` layers (at least the smaller log's)."""
        if layers < self.layers:
            raise NoReplay(f"{layers} layers: fewer than the template's {self.layers}")
        out: list[MemoryEvent] = []
        keys: dict[tuple, int] = {}  # (slot, period) -> the key its alloc got
        pending: list[tuple[int, tuple]] = []  # (index in out, (slot, period)): an event before its storage's alloc
        self._identified: dict[tuple, int] = {}  # an allocated storage's identity (`layer_identity`) -> its key
        self._counts: dict[tuple, int] = {}  # (shape, layer) -> the allocs of it so far
        try:
            self._emit_all(out, keys, pending, layers)
        except NotWhole as error:
            raise NoReplay(str(error)) from None
        for index, target in pending:
            found = self._identified.get(target[1:]) if target[0] == "identity" else keys.get(target)
            if found is None:
                raise NoReplay(f"an event at {layers} layers names a storage never allocated")
            out[index] = out[index]._replace(key=found)
        return out

    def _emit_all(self, out: list, keys: dict, pending: list, layers: int) -> None:
        extra = layers - self.layers - 1  # periods each run gains over the larger log
        position = 0
        for index, run in enumerate(self.runs):
            for fixed in range(position, run.start):
                self._emit(out, keys, pending, ("fixed", fixed), 0, layers, "middle")
            periods = run.periods + extra
            for period in range(periods):
                edge = "first" if period == 0 else "last" if period == periods - 1 else "middle"
                for offset in range(run.length):
                    self._emit(out, keys, pending, ("run", index, offset), period, layers, edge)
            position = run.start + run.length * run.periods
        for fixed in range(position, len(self.larger)):
            self._emit(out, keys, pending, ("fixed", fixed), 0, layers, "middle")

    def _emit(self, out: list, keys: dict, pending: list, slot: tuple, period: int, layers: int, edge: str) -> None:
        program = self._programs.get((slot, edge))
        if program is None:
            program = self._programs[slot, edge] = self._program(slot, edge)
        event, target, parts, numbers = program
        key = event.key
        if event.kind == "alloc":
            key = keys[(slot, period)] = len(keys) + 1
            if self._by_layer:  # what it is, for the events that name their storage by it
                kind = (target, _evaluate(numbers[0], period, layers) if numbers else None)
                count = self._counts[kind] = self._counts.get(kind, -1) + 1
                self._identified[(*kind, count)] = key
        elif target is not None:
            if target[0] == "key":
                key = target[1]
            elif target[0] == "identity":
                named = (target[1], _evaluate(target[2], period, layers), target[3])
                key = self._identified.get(named, 0)
                if not key:
                    pending.append((len(out), ("identity", *named)))
            else:
                named = (target[1], _target_period(target, period, layers))
                key = keys.get(named, 0)
                if not key:
                    pending.append((len(out), named))
        module = event.module
        if numbers:
            pieces = [parts[0]]
            for coefficients, part in zip(numbers, parts[1:]):
                pieces.append(str(_evaluate(coefficients, period, layers)))
                pieces.append(part)
            module = "".join(pieces)
        out.append(MemoryEvent(event.kind, key, event.nbytes, event.stage, event.op, module, event.category))

    def _program(self, slot: tuple, edge: str) -> tuple:
        """What `_emit` needs for a slot in periods at `edge`: its event in the larger log, how it names its storage
        (None, ("key", key), ("affine", slot, coefficients), ("layer", slot, source layer, target layer, offset) or
        ("identity", shape, layer coefficients, count); an alloc: its shape), its module name cut around its numbers,
        and each number's coefficients."""
        event = self.larger[slot[1] if slot[0] == "fixed" else self.runs[slot[1]].start + slot[2]]
        target = None
        if event.kind in ("free", "category"):
            named, how, parameter = self._model(slot, "target", edge)
            if how == "key":
                target = ("key", named[1])
            elif how == "affine":
                target = ("affine", named, parameter)
            elif how == "identity":
                target = ("identity", *parameter)
            else:
                target = ("layer", named, self._layer_of_run[slot[1]], self._layer_of_run[named[1]], parameter)
        elif event.kind == "alloc":
            target = _alloc_shape(event)
        parts = _MODULE_INDEX.split(event.module) if event.module else [event.module]
        numbers = [self._model(slot, ("index", place), edge) for place in range(len(parts) - 1)]
        return event, target, parts, numbers

    def _model(self, slot: tuple, name, edge: str):
        edges, models = self._models[slot, name]
        model = models.get(edge if edge in edges else "middle")
        if model is None:
            raise NoReplay(f"{slot}: no model of its {name} in its {edge} periods")
        return model


def _target_period(target: tuple, period: int, layers: int) -> int:
    """The period of the storage an event names (see `LayerTemplate._program`), at `period` and `layers`."""
    if target[0] == "affine":
        return _evaluate(target[2], period, layers)
    _, _, source, goal, offset = target
    wanted = _evaluate(source, period, layers) + offset  # the layer of the storage named
    numerator = wanted - goal[0] - goal[2] * layers
    if type(numerator) is int and type(goal[1]) is int:  # whole coefficients: no Fraction (most of making a log)
        found, rest = divmod(numerator, goal[1])
    else:
        exact = Fraction(numerator) / goal[1]
        found, rest = int(exact), exact.denominator != 1
    if rest:
        raise NoReplay(f"no period of a run has layer {wanted}")
    return found
