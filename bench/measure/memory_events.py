"""The records the live-tensor tracker (bench.measure.memory) logs: its event log of allocations, frees, operators
and peak resets, and its timeline of live bytes after each operator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class MemoryEvent(NamedTuple):
    """One entry of the tracker's event log: a storage allocated or freed, an operator run, or the peak reset.

    `kind` is "alloc" (`nbytes` the storage's exact bytes), "free", "op" (`op` its name) or "reset"; `key` numbers
    the storage (an alloc and its free share it); `stage` is the tracker's stage when it happened. A named tuple,
    immutable: a full-size step logs hundreds of thousands, and a frozen dataclass took several times as long to make.
    """

    kind: str
    key: int = 0
    nbytes: int = 0
    stage: str = ""
    op: str = ""
    module: str = ""  # an alloc's module (`module_of()`: set by bench.measure.snapshot.ModuleScope), "" if unknown
    category: str = ""  # an alloc's category when registered, a free's when freed


@dataclass
class TimelinePoint:
    """Live bytes right after one operator ran."""

    index: int
    stage: str
    op: str
    live_bytes: int
