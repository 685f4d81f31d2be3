"""Keeping Python's cyclic garbage collector from walking, again and again, large structures that hold no garbage:
a full-size step's event log (hundreds of thousands of tuples) while pure-Python code builds or walks it
(`collector_paused`; making llama-3.1-70b's 263,214-event log by layer replay took 0.64-0.89 s with the collector
running, 0.22-0.25 s paused), and the objects the imports of torch, transformers and pandas make (`frozen_after`).
Never around a traced step: there the moments the collector runs decide when a step's cycles free their tensors, as
in the user's run (a fake-CUDA mode's `heap_frozen` decides them there)."""

from __future__ import annotations

import contextlib
import gc
import importlib
import sys
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


def imported_paused(module: str, name: str):
    """`name` from `module`, imported inside `frozen_after`."""
    with frozen_after():
        return getattr(importlib.import_module(module), name)


@contextlib.contextmanager
def frozen_after() -> Iterator[None]:
    """For a block that may import torch, transformers or pandas: the collector paused inside and, where the block
    imported a module, every object then alive moved out of its reach (`gc.freeze`). Those imports make hundreds of
    thousands of long-lived objects, none of them garbage, and the full collections they triggered walked all of
    them again: 0.75 s of gen-2 collections in a cold `predict` of llama-3.1-70b (paused alone, the first
    collection after the block walked them once more, 0.24 s); frozen, 0.02 s. The frozen objects go back to the
    collector when a fake-CUDA mode ends (`heap_frozen` unfreezes every frozen object), so nothing stays out of
    its reach for good."""
    modules = len(sys.modules)
    with collector_paused():
        try:
            yield
        finally:
            if len(sys.modules) != modules:  # before the collector is back: its first collection would walk them all
                gc.freeze()
