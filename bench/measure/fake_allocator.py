"""The fake CUDA allocator: the live bytes of fake CUDA tensors counted as CUDA's caching allocator would hand them
out (512-byte blocks), torch.cuda's allocator statistics answered from that count, and CUDA's out-of-memory error
past the process's memory fraction (`bench.measure.fake_cuda_mode.fake_cuda` enters it)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils.weak import WeakIdKeyDictionary

from bench.core.memory_categories import OUTSIDE_ALLOCATOR
from bench.measure.memory import LiveTensorTracker


class FakeAllocator(LiveTensorTracker):
    """Live bytes of fake CUDA tensors (512-byte blocks, as CUDA's allocator rounds), with an out-of-memory error past
    `limit_bytes`, or past the memory fraction of the device's memory when no limit is given. It stands for CUDA's
    caching allocator, so a storage made in a category that allocator never serves (`OUTSIDE_ALLOCATOR`: unified
    memory, bitsandbytes' paged optimizer state) is not counted.

    `counted_by`: a tracker of the fake CUDA bytes that, while it is entered, counts every storage this allocator
    would (a prediction's memory pass: it registers the parameters, buffers and batch made before it, and every
    operator's tensors). Meanwhile this allocator leaves the operators to it (registering them twice was a tenth of a
    traced step; it is off the dispatch mode stack then) and torch.cuda's statistics are its figures; after it, its
    own count lacks what was made inside."""

    def __init__(self, limit_bytes: int | None = None, counted_by: LiveTensorTracker | None = None):
        super().__init__("cuda", block_bytes=512)
        self.limit_bytes = limit_bytes
        self.counted_by = counted_by
        self._outside: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storages the caching allocator never serves

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._counting() is not self:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    passes_through_while = property(lambda self: self.counted_by)  # bench.measure.mode_aside

    def _counting(self) -> LiveTensorTracker:
        """The tracker whose figures torch.cuda's statistics are now: `counted_by` while it is entered, else this."""
        return self.counted_by if self.counted_by is not None and self.counted_by.entered else self

    def _reset_peak_statistic(self) -> None:
        """torch.cuda.reset_peak_memory_stats: this count's peak restarts; `counted_by`'s window is left alone."""
        if self._counting() is self:
            self.reset_peak()

    def _register(self, t: torch.Tensor, category: str) -> None:
        if category not in OUTSIDE_ALLOCATOR and not self._outside:  # the usual case, at the usual cost
            super()._register(t, category)
            return
        t = getattr(t, "_local_tensor", t)
        if is_traceable_wrapper_subclass(t):
            super()._register(t, category)  # which registers the tensors inside it, through this method
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        if category in OUTSIDE_ALLOCATOR:
            self._outside[storage] = True  # and not when an operator reads it later either
        elif storage not in self._outside:
            super()._register(t, category)

    def capacity(self) -> int:
        """The bytes past which an allocation fails: the limit given, else the memory fraction of the device."""
        if self.limit_bytes is not None:
            return self.limit_bytes
        total = torch.cuda.get_device_properties(0).total_memory
        return int(torch.cuda.get_per_process_memory_fraction(0) * total)

    def _update_peak(self, op: str) -> None:
        """The tracker's peak update after each operator, then CUDA's out-of-memory error if over capacity."""
        super()._update_peak(op)
        if self.live_bytes > self.capacity():
            raise torch.OutOfMemoryError(f"CUDA out of memory (fake allocator): {op} brought the live bytes to "
                                         f"{self.live_bytes}, over {self.capacity()}")

    @contextlib.contextmanager
    def answering_memory_queries(self) -> Iterator[None]:
        """torch.cuda's allocator statistics (what the runner reads) answered from this count while inside: the real
        allocator never sees a fake tensor, so it would say 0 for every figure."""
        cuda = torch.cuda
        names = ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
                 "reset_peak_memory_stats")
        saved = {name: getattr(cuda, name) for name in names}
        answers = {"memory_allocated": lambda device=None: self._counting().live_bytes,
                   "max_memory_allocated": lambda device=None: self._counting().peak_bytes,
                   "memory_reserved": lambda device=None: self._counting().live_bytes,
                   "max_memory_reserved": lambda device=None: self._counting().peak_bytes,
                   "reset_peak_memory_stats": lambda device=None: self._reset_peak_statistic()}
        for name in names:
            setattr(cuda, name, answers[name])
        try:
            yield
        finally:
            for name in names:
                setattr(cuda, name, saved[name])
