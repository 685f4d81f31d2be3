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
storage keys in the order allocated, as the tracker numbers them. Over two kinds of layers (`LayerTemplate.of_kinds`:
checkpointed, then plain) the logs at (c, p), (c+1, p) and (c, p+1) make one template: each run grows with the layers
of the kinds it repeats for, and each number is an affine function of the period and both counts.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Sequence

from bench.core.collector import collector_paused
from bench.measure.exact_affine import NotWhole, evaluate as _evaluate, layer_terms, solve as _solve
from bench.measure.layer_alignment import NoReplay, align, kinds_runs, runs_of, tokens
from bench.measure.layer_identity import (MODULE_INDEX as _MODULE_INDEX, alloc_shape as _alloc_shape, by_layer_model,
                                          identities, module_numbers)
from bench.measure.memory import MemoryEvent

# the periods fitted apart, tried in turn; a storage named by what it is and its layer only where no slot fits it
_FITS = [(edges, by_layer) for by_layer in (False, True) for edges in ((), ("first",), ("last",), ("first", "last"))]


class LayerTemplate:
    """The log of a step at any layer count, made from its logs at `layers` and `layers + 1` (see the module); by
    `of_kinds`, at any counts of two kinds of layers."""

    @collector_paused()
    def __init__(self, smaller: Sequence[MemoryEvent], larger: Sequence[MemoryEvent], layers: int):
        codes: dict = {}
        large_tokens = tokens(larger, codes)
        sites = align(tokens(smaller, codes), large_tokens)
        if not sites:
            raise NoReplay("one more layer adds no event")
        self._make(runs_of(large_tokens, sites), larger, layers + 1, layers, ((smaller, layers), (larger, layers + 1)))

    @classmethod
    @collector_paused()
    def of_kinds(cls, base: Sequence[MemoryEvent], more: Sequence[Sequence[MemoryEvent]],
                 layers: tuple[int, ...]) -> LayerTemplate:
        """The template over counts of several kinds of layers (checkpointed, plain) from the log at `layers` and,
        per kind, the log with one more layer of that kind (`more`): each run grows by the layers of the kinds
        that lengthen it, and each number is an affine function of the period and every kind's count."""
        codes: dict = {}
        template = cls.__new__(cls)
        known = [tokens(log, codes) for log in (base, *more)]
        grown = [tuple(count + (kind == other) for other, count in enumerate(layers)) for kind in range(len(layers))]
        template._make(kinds_runs(known[0], known[1:]), base, layers, layers, [(base, layers), *zip(more, grown)],
                       known)
        return template

    def _make(self, runs: list, reference: Sequence[MemoryEvent], reference_layers, smallest_layers, logs,
              known: list | None = None) -> None:
        """`runs` in the `reference` log (at `reference_layers`), the models fitted on `logs` ((events, layers)
        each); the template makes logs of at least `smallest_layers`. With `known` (the reference's tokens, then
        each log's), each log must be the template walked at its layers, event for event (one alignment does not
        ensure it of another's runs)."""
        self.runs, self.larger, self.layers, self._reference_layers = runs, list(reference), smallest_layers, \
            reference_layers
        placed = []
        for index, (events, layers) in enumerate(logs):
            places = self._places(layers)
            if known is not None:
                slots = [slot[1] if slot[0] == "fixed" else self.runs[slot[1]].start + slot[2] for slot, _ in places]
                if [known[0][slot] for slot in slots] != known[index]:
                    raise NoReplay(f"the log at {layers} layers is not the template's")
            placed.append((events, places, layers))
        try:
            self._fit(placed)
        except NotWhole as error:
            raise NoReplay(str(error)) from None
        self._programs: dict[tuple, tuple] = {}  # (slot, edge) -> what `_emit` needs (`_program`)
        self._by_layer = any(model[1] == "identity" for _, models in self._models.values() for model in models.values())

    def _periods(self, run, layers) -> int:
        """How many periods a run has at `layers` (a count, or a count per kind)."""
        if type(layers) is int:
            return run.periods + run.growth[0] * (layers - self._reference_layers)
        return run.periods + sum(grows * (count - reference)
                                 for grows, count, reference in zip(run.growth, layers, self._reference_layers))

    def _places(self, layers) -> list[tuple[tuple, int]]:
        """The slot (a fixed event's position in the reference log, or a run's offset) and period of each event of
        the log at `layers`: the template walked with each run's periods there."""
        places: list[tuple[tuple, int]] = []
        position = 0
        for index, run in enumerate(self.runs):
            places += [(("fixed", fixed), 0) for fixed in range(position, run.start)]
            places += [(("run", index, offset), period) for period in range(self._periods(run, layers))
                       for offset in range(run.length)]
            position = run.start + run.length * run.periods
        return places + [(("fixed", fixed), 0) for fixed in range(position, len(self.larger))]

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
            periods = [self._periods(run, layers) for run in self.runs]
            # a "category" event may come just before its storage's alloc (`breakdown.CategorizedTracker`)
            alloc_place = {event.key: place for event, place in zip(events, places) if event.kind == "alloc"}
            for event, (slot, period) in zip(events, places):
                quantities: dict = {}
                if event.kind in ("free", "category"):
                    found = alloc_place.get(event.key)
                    # a storage the log never allocated is named as is
                    quantities["target"] = (("key", event.key, None) if found is None
                                              else (found[0], found[1], named[event.key]))
                if event.module:
                    for place, number in enumerate(module_numbers(event.module)):
                        quantities["index", place] = number
                if not quantities:  # an operator's event: nothing in it changes with the layers
                    continue
                edge = _edge(period, periods[slot[1]]) if slot[0] == "run" else "middle"
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

    @collector_paused()
    def events(self, layers: int) -> list[MemoryEvent]:
        """The step's log at `layers` layers (at least the smaller log's)."""
        if min(_excess(layers, self.layers)) < 0:
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

    def _emit_all(self, out: list, keys: dict, pending: list, layers) -> None:
        """Appends the log at `layers` to `out`: each slot's program compiled once per edge for this count
        (`_compiled`), then walked period by period."""
        compiled: dict[tuple, tuple] = {}

        def programs(slots: list, edge: str) -> list:
            return [compiled.get((slot, edge)) or compiled.setdefault((slot, edge), self._compiled(slot, edge, layers))
                    for slot in slots]

        position = 0
        for index, run in enumerate(self.runs):
            self._emit_period(out, keys, pending, programs([("fixed", f) for f in range(position, run.start)],
                                                             "middle"), 0)
            periods = self._periods(run, layers)
            slots = [("run", index, offset) for offset in range(run.length)]
            by_edge: dict[str, list] = {}
            for period in range(periods):
                edge = _edge(period, periods)
                walked = by_edge.get(edge) or by_edge.setdefault(edge, programs(slots, edge))
                self._emit_period(out, keys, pending, walked, period)
            position = run.start + run.length * run.periods
        self._emit_period(out, keys, pending, programs([("fixed", f) for f in range(position, len(self.larger))],
                                                       "middle"), 0)

    def _emit_period(self, out: list, keys: dict, pending: list, programs: list, period: int) -> None:
        """Appends one period's events (`_compiled` programs) to `out`."""
        append, identified, counts, by_layer = out.append, self._identified, self._counts, self._by_layer
        for slot, event, target, shape, parts, numbers in programs:
            if slot is None:  # an operator's event: the same at any count
                append(event)
                continue
            key = event.key
            if shape is not None:  # an alloc
                key = keys[(slot, period)] = len(keys) + 1
                if by_layer:  # what it is, for the events that name their storage by it
                    kind = (shape, _whole(numbers[0][0] + numbers[0][1] * period) if numbers else None)
                    count = counts[kind] = counts.get(kind, -1) + 1
                    identified[(*kind, count)] = key
            elif target is not None:
                how = target[0]
                if how == "key":
                    key = target[1]
                elif how == "identity":
                    named = (target[1], _whole(target[2] + target[3] * period), target[4])
                    key = identified.get(named, 0)
                    if not key:
                        pending.append((len(out), ("identity", *named)))
                else:
                    if how == "affine":
                        found = _whole(target[2] + target[3] * period)
                    else:  # by layer: the storage's layer, then the period of the target run that has it
                        wanted = _whole(target[2] + target[3] * period) + target[4]
                        found, rest = _divide(wanted - target[5], target[6])
                        if rest:
                            raise NoReplay(f"no period of a run has layer {wanted}")
                    named = (target[1], found)
                    key = keys.get(named, 0)
                    if not key:
                        pending.append((len(out), named))
            module = event.module
            if numbers:
                if len(numbers) == 1:
                    base, per_period = numbers[0]
                    module = parts[0] + str(_whole(base + per_period * period)) + parts[1]
                else:
                    pieces = [parts[0]]
                    for (base, per_period), part in zip(numbers, parts[1:]):
                        pieces.append(str(_whole(base + per_period * period)))
                        pieces.append(part)
                    module = "".join(pieces)
            append(_new_event((event.kind, key, event.nbytes, event.stage, event.op, module, event.category)))

    def _compiled(self, slot: tuple, edge: str, layers) -> tuple:
        """A slot's program (`_program`) at `layers`: (None, event, None...) for an event the same at any count, else
        (slot, event, target, alloc shape, module parts, numbers), each affine function of the period and the count
        in it turned into (its value at period 0, its step per period) at this count. The target: ("key", key),
        ("identity", shape, layer at 0, step, count), ("affine", slot, period at 0, step) or ("layer", slot, source
        layer at 0, step, offset, target run's layer at 0, its step): the storage's layer is the source's plus the
        offset, and the period of the target run with that layer is the target's."""
        program = self._programs.get((slot, edge))
        if program is None:
            program = self._programs[slot, edge] = self._program(slot, edge)
        event, target, parts, numbers = program
        if target is None and not numbers and event.kind != "alloc":
            return None, event, None, None, None, None
        shape = target if event.kind == "alloc" else None
        if shape is not None:
            target = None
        elif target is not None and target[0] == "affine":
            target = ("affine", target[1], *_at(target[2], layers))
        elif target is not None and target[0] == "identity":
            target = ("identity", target[1], *_at(target[2], layers), target[3])
        elif target is not None and target[0] == "layer":
            _, named, source, goal, offset = target
            target = ("layer", named, *_at(source, layers), offset, *_at(goal, layers))
        return slot, event, target, shape, parts, [_at(coefficients, layers) for coefficients in numbers]

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


def _edge(period: int, periods: int) -> str:
    """Where `period` sits in a run of `periods`: "first", "last" or "middle" (the templates fit and make them apart)."""
    return "first" if period == 0 else "last" if period == periods - 1 else "middle"


def _at(coefficients, layers) -> tuple:
    """An affine function of (period, layers) at `layers`: (its value at period 0, its step per period), exact."""
    return coefficients[0] + layer_terms(coefficients, layers), coefficients[1]


def _whole(value) -> int:
    """`value` (an int, or a Fraction from a fractional fit) as an int; NotWhole where it is a fraction."""
    if type(value) is int:
        return value
    if value.denominator != 1:
        raise NotWhole("a fitted number is not whole at this layer count")
    return int(value)


def _divide(numerator, step) -> tuple[int, bool]:
    """(numerator // step, whether it leaves a rest), exact: without Fractions where both are whole (most of making
    a log)."""
    if type(numerator) is int and type(step) is int:
        found, rest = divmod(numerator, step)
        return found, bool(rest)
    exact = Fraction(numerator) / step
    return int(exact), exact.denominator != 1


def _new_event(fields: tuple) -> MemoryEvent:
    return tuple.__new__(MemoryEvent, fields)


def _excess(layers, smallest) -> tuple[int, ...]:
    """How many layers of each kind `layers` has over `smallest` (counts, or counts per kind)."""
    return (layers - smallest,) if type(layers) is int else tuple(a - b for a, b in zip(layers, smallest))
