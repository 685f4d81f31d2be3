"""Progress inside a case (which pass, which step), reported to whoever listens: the CLI's progress line.

The lowest layer: measurement and the runner report, the CLI listens (`listening(callback)`). Reports are made
between steps, never inside a timed one.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

Listener = Callable[[str, int, int], None]  # (what is running, steps done, steps in all)
_listeners: list[Listener] = []


def report(what: str, done: int, total: int) -> None:
    """Tells every listener that `done` of `total` steps of `what` (e.g. "timing") have run."""
    for listener in _listeners:
        listener(what, done, total)


@contextlib.contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Calls `listener` with every report made inside the block."""
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)
