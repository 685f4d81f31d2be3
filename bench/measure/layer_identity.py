"""Storages of a step's event log named by what they are and which layer they belong to, not by where they sit in a
layer template: the optimizer's run over every layer frees the gradients of checkpointed and of plain layers, which
sit in two kinds of periods (bench.measure.layer_template names a storage so where no one slot holds it)."""

from __future__ import annotations

import functools
import re
from typing import Sequence

from bench.measure.exact_affine import solve
from bench.measure.memory import MemoryEvent

# the numbers in a module's dotted name (a layer's index in its ModuleList, an expert's): they change with the layer
MODULE_INDEX = re.compile(r"(?:^|(?<=\.))\d+(?=\.|\s|$)")


# a log names a few hundred modules in hundreds of thousands of events: each name's pattern and numbers are found once
@functools.lru_cache(maxsize=None)
def module_pattern(module: str) -> str:
    """The module's dotted name with its numbers (MODULE_INDEX) replaced by "#"."""
    return MODULE_INDEX.sub("#", module)


@functools.lru_cache(maxsize=None)
@functools.lru_cache(maxsize=None)  # a log names a few hundred modules, each in thousands of events
def module_numbers(module: str) -> tuple[str, ...]:
    """The numbers in the module's dotted name (MODULE_INDEX), in order."""
    return tuple(MODULE_INDEX.findall(module))


def identities(events: Sequence[MemoryEvent]) -> dict[int, tuple]:
    """Each storage the log allocates by what it is: (its alloc's shape without the numbers in its module's name,
    the first of those numbers (its layer) or None, how many allocs of that shape and layer came before it)."""
    found, counts = {}, {}  # key -> identity; (shape, layer) -> allocs so far
    for event in events:
        if event.kind == "alloc":
            numbers = module_numbers(event.module)
            kind = (alloc_shape(event), int(numbers[0]) if numbers else None)
            counts[kind] = counts.get(kind, -1) + 1
            found[event.key] = (*kind, counts[kind])
    return found


def alloc_shape(event: MemoryEvent) -> tuple:  # what an alloc is, without the numbers in its module's name
    return event.nbytes, event.stage, event.op, module_pattern(event.module), event.category


def by_layer_model(members: list) -> tuple | None:
    """A slot naming storages of several slots, by what they are (`identities`): (None, "identity", (their shape,
    their layer's affine coefficients, their count)); None where they differ in shape or count, or have no layer."""
    named = [value[2] if value[0] != "key" else None for _, _, value in members]
    if any(identity is None or identity[1] is None for identity in named):
        return None
    kinds = {(identity[0], identity[2]) for identity in named}
    coefficients = solve([(period, layers, identity[1]) for (period, layers, _), identity in zip(members, named)])
    if len(kinds) != 1 or coefficients is None:
        return None
    shape, count = kinds.pop()
    return None, "identity", (shape, coefficients, count)
