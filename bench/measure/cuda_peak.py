"""A real CUDA step's peak memory, as CUDA's caching allocator counts it (`max_memory_allocated`/`_reserved`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class CudaPeak:
    """Peak bytes of one CUDA step, from the caching allocator's statistics."""

    allocated_bytes: int
    reserved_bytes: int


def cuda_peak(step: Callable[[], None]) -> CudaPeak:
    """Resets the peak statistics, runs one step, and reads `max_memory_allocated` / `max_memory_reserved`."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return CudaPeak(torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
