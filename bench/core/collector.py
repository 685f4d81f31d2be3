"""Pausing Python's cyclic garbage collector while pure-Python code builds or walks large acyclic structures (a
full-size step's event log: hundreds of thousands of tuples), where each full collection would walk all of them
again: making llama-3.1-70b's 263,214-event log by layer replay took 0.64-0.89 s with the collector running and
0.22-0.25 s paused (one process, this 2-core machine). Never around a traced step:
there the moments the collector runs decide when a step's cycles free their tensors, as in the user's run."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off inside (also as a decorator), back on at exit where it was on at entry: reference
    counting still frees what the code drops, and what it makes is collected once the collector runs again."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
