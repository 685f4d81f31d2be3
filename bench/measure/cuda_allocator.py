"""A model of CUDA's caching allocator and of the cuBLAS workspaces it serves, to predict what a GPU would report.

`CachingAllocatorModel` follows `c10/cuda/CUDACachingAllocator.cpp` with its default settings (no
`PYTORCH_CUDA_ALLOC_CONF`: no `max_split_size_mb`, no power-of-two rounding, no expandable segments), one device
and one stream:
- every request is rounded up to a multiple of 512 bytes (`kMinBlockSize`; 0 bytes allocate nothing);
- requests up to 1 MiB (`kSmallSize`) are served from the small pool, whose segments are 2 MiB (`kSmallBuffer`);
  larger ones from the large pool, whose segments are 20 MiB (`kLargeBuffer`) for requests under 10 MiB
  (`kMinLargeAlloc`) and the request rounded up to 2 MiB (`kRoundLarge`) above;
- a request takes the smallest free block that fits (best fit; the lowest address among equal sizes), else a
  new segment (cudaMalloc);
- the block is split when what remains is at least 512 bytes (small pool) or more than 1 MiB (large pool);
  otherwise the whole block is handed out, and `memory_allocated` counts the whole block;
- a freed block merges with its free neighbours in the same segment; segments are never returned (no
  `empty_cache`), so reserved memory only grows.
`memory_allocated` is the sum of handed-out blocks, `memory_reserved` the sum of segments, each with its peak since
the last `reset_peak()`, as `torch.cuda.max_memory_allocated`/`max_memory_reserved` after
`reset_peak_memory_stats`.

`replay` runs the event log of `bench.measure.memory.LiveTensorTracker(record_events=True)` through the model, adding
cuBLAS's workspace (allocated through the caching allocator the first time a thread runs a cuBLAS operator on a
stream, and kept: https://github.com/pytorch/pytorch/issues/95668) for the main thread and for autograd's device
thread, which runs the backward on CUDA. Where the log says each storage's category ("category" events of
`bench.measure.breakdown.CategorizedTracker`), the replay also says what the allocated peak is made of: the blocks
handed out at that moment by their storage's category (`CUBLAS_WORKSPACE` for the workspaces, `UNCATEGORIZED` for a
storage the log gave none), which sum to it. A storage made in a category the caching allocator never serves
(`bench.core.memory_categories.OUTSIDE_ALLOCATOR`: CUDA unified memory, bitsandbytes' paged optimizer state) is left
out of the model: `torch.cuda.memory_stats` does not count it.
"""

from __future__ import annotations

import bisect
import os
import re
from dataclasses import dataclass, field
from typing import Iterable

from bench.core.collector import collector_paused
from bench.core import memory_categories
from bench.core.memory_categories import OUTSIDE_ALLOCATOR
from bench.core.units import KiB, MiB

K_MIN_BLOCK_SIZE = 512
K_SMALL_SIZE = 1 * MiB
K_SMALL_BUFFER = 2 * MiB
K_LARGE_BUFFER = 20 * MiB
K_MIN_LARGE_ALLOC = 10 * MiB
K_ROUND_LARGE = 2 * MiB

# cuBLAS's workspace per (handle, stream), from aten/src/ATen/cuda/CublasHandlePool.cpp: ":4096:2:16:8" (two of
# 4096 KiB and eight of 16 KiB) by default, 32 MiB on compute capability 9.0 (Hopper); CUBLAS_WORKSPACE_CONFIG
# (":SIZE_KiB:COUNT" pairs) replaces it. cuBLASLt shares it (TORCH_CUBLASLT_UNIFIED_WORKSPACE, on by default).
CUBLAS_DEFAULT_WORKSPACE_BYTES = 4096 * KiB * 2 + 16 * KiB * 8  # 8,519,680
CUBLAS_HOPPER_WORKSPACE_BYTES = 4096 * KiB * 8  # 33,554,432
# aten operators that call cuBLAS on CUDA (matrix products; convolutions go to cuDNN)
CUBLAS_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "_addmm_activation",
                        "addr", "_scaled_mm"})


CUBLAS_WORKSPACE = "cublas_workspace"  # the category of the workspaces' blocks at the peak
UNCATEGORIZED = "uncategorized"


def round_size(nbytes: int) -> int:
    """A request's size as the allocator rounds it: a multiple of 512 bytes, at least 512."""
    return max(K_MIN_BLOCK_SIZE, -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE)


def allocation_size(size: int) -> int:
    """The size of the segment cudaMalloc'ed for a (rounded) request that no cached block can serve."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


def cublas_workspace_bytes(capability: tuple[int, int] | None = None, config: str | None = None) -> int:
    """cuBLAS's workspace for one handle and stream on a device of compute `capability` (default: not Hopper), or as
    `config` (CUBLAS_WORKSPACE_CONFIG, e.g. ":4096:8") says; a config with no ":SIZE:COUNT" pair is ignored, as
    PyTorch ignores it (with a warning)."""
    default = CUBLAS_HOPPER_WORKSPACE_BYTES if capability == (9, 0) else CUBLAS_DEFAULT_WORKSPACE_BYTES
    pairs = re.findall(r":([0-9]+):([0-9]+)", config or "")
    if not pairs:
        return default
    return sum(int(size) * KiB * int(count) for size, count in pairs)


@dataclass(eq=False)
class Block:
    """A piece of a segment: handed out (`allocated`) or free; `prev`/`next` are its neighbours in the segment."""

    address: int
    size: int
    small: bool
    allocated: bool = False
    prev: Block | None = None
    next: Block | None = None


@dataclass
class AllocatorStats:
    """What torch.cuda.memory_stats would say: current and peak allocated and reserved bytes, and segments."""

    allocated_bytes: int = 0
    reserved_bytes: int = 0
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    segments: int = 0


class CachingAllocatorModel:
    """CUDA's caching allocator with its default settings, one device, one stream (see the module's docstring)."""

    def __init__(self):
        self.stats = AllocatorStats()
        self._free: dict[bool, list[tuple[int, int, Block]]] = {True: [], False: []}  # small? -> sorted (size, address)
        self._next_address = 0

    def malloc(self, nbytes: int) -> Block | None:
        """Hands out a block for a request of `nbytes` (None for 0 bytes, which CUDA serves without memory)."""
        if nbytes == 0:
            return None
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE
        block = self._best_fit(size, small) or self._new_segment(allocation_size(size), small)
        remaining = block.size - size
        if remaining >= K_MIN_BLOCK_SIZE if small else remaining > K_SMALL_SIZE:
            rest = Block(block.address + size, remaining, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert_free(rest)
        block.allocated = True
        self.stats.allocated_bytes += block.size
        self.stats.peak_allocated_bytes = max(self.stats.peak_allocated_bytes, self.stats.allocated_bytes)
        return block

    def free(self, block: Block | None) -> None:
        """Returns a block to its pool, merged with its free neighbours."""
        if block is None:
            return
        block.allocated = False
        self.stats.allocated_bytes -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._remove_free(neighbour)
                if neighbour is block.prev:
                    block.address, block.prev = neighbour.address, neighbour.prev
                    if block.prev is not None:
                        block.prev.next = block
                else:
                    block.next = neighbour.next
                    if block.next is not None:
                        block.next.prev = block
                block.size += neighbour.size
        self._insert_free(block)

    def reset_peak(self) -> None:
        """torch.cuda.reset_peak_memory_stats: the peaks restart from the current figures."""
        self.stats.peak_allocated_bytes = self.stats.allocated_bytes
        self.stats.peak_reserved_bytes = self.stats.reserved_bytes

    # internals ------------------------------------------------------------------------------------------
    def _best_fit(self, size: int, small: bool) -> Block | None:
        """Takes the smallest free block of the pool with at least `size` bytes (lowest address on a tie)."""
        pool = self._free[small]
        index = bisect.bisect_left(pool, (size, -1))
        if index == len(pool):
            return None
        return pool.pop(index)[2]

    def _new_segment(self, segment_bytes: int, small: bool) -> Block:
        """cudaMalloc: a new segment, at an address above every earlier one, as one free-to-hand-out block."""
        block = Block(self._next_address, segment_bytes, small)
        self._next_address += segment_bytes
        self.stats.reserved_bytes += segment_bytes
        self.stats.segments += 1
        self.stats.peak_reserved_bytes = max(self.stats.peak_reserved_bytes, self.stats.reserved_bytes)
        return block

    def _insert_free(self, block: Block) -> None:
        """Files a free block in its pool, ordered by (size, address)."""
        bisect.insort(self._free[block.small], (block.size, block.address, block))

    def _remove_free(self, block: Block) -> None:
        """Takes a free block out of its pool (it is being merged into a neighbour)."""
        pool = self._free[block.small]
        index = bisect.bisect_left(pool, (block.size, block.address))
        assert pool[index][2] is block, "free list out of order"
        del pool[index]


@dataclass
class ReplayResult:
    """The model's figures for the window after the log's last peak reset (the measured step)."""

    max_allocated_bytes: int
    max_reserved_bytes: int
    cublas_workspaces: int
    cublas_workspace_bytes: int
    stats: AllocatorStats = field(repr=False, default_factory=AllocatorStats)
    # the blocks handed out at the allocated peak, by category (they sum to max_allocated_bytes)
    peak_by_category: dict[str, int] = field(default_factory=dict)


def outside_allocator(event, category: str | None = None) -> bool:
    """Whether an "alloc" event is of a storage the caching allocator never serves: its category (`category`, from
    the log's "category" events, else the alloc's own) is in `OUTSIDE_ALLOCATOR`."""
    return (category or event.category) in OUTSIDE_ALLOCATOR


def thread_of(stage: str) -> str:
    """The thread that runs a stage on CUDA: autograd's device thread for the backward, the caller's otherwise."""
    return "autograd" if stage == "backward" else "main"


@collector_paused()
def replay(events: Iterable, workspace_bytes: int = CUBLAS_DEFAULT_WORKSPACE_BYTES) -> ReplayResult:
    """Runs a tracker's event log (`bench.measure.memory.MemoryEvent`s) through a fresh `CachingAllocatorModel`,
    with one cuBLAS workspace of `workspace_bytes` per thread that runs a cuBLAS operator (0: none); the allocated
    peak's blocks by category where the log has "category" events."""
    model = CachingAllocatorModel()
    blocks: dict[int, Block | None] = {}
    category_of: dict[int, str] = {}
    live: dict[str, int] = {}  # handed-out bytes by category
    at_peak: dict[str, int] = {}
    threads_with_workspace: set[str] = set()

    def count(category: str, nbytes: int) -> None:
        live[category] = live.get(category, 0) + nbytes

    def allocated(block: Block | None, category: str) -> None:
        nonlocal at_peak
        if block is not None:
            count(category, block.size)
            if model.stats.allocated_bytes == model.stats.peak_allocated_bytes and model.stats.allocated_bytes > sum(
                    at_peak.values()):
                at_peak = dict(live)

    for event in events:
        if event.kind == "alloc":
            if outside_allocator(event, category_of.get(event.key)):
                blocks[event.key] = None  # unified memory: no block of the allocator's
                continue
            blocks[event.key] = block = model.malloc(event.nbytes)
            # a workspace is filed as one when made (never by a later "category" event: it is freed first)
            held_while_running = event.category in memory_categories.HELD_WHILE_RUNNING
            allocated(block, category_of.setdefault(event.key, event.category if held_while_running else UNCATEGORIZED))
        elif event.kind == "category":
            block = blocks.get(event.key)
            if block is not None:
                count(category_of.get(event.key, UNCATEGORIZED), -block.size)
                count(event.op, block.size)
            category_of[event.key] = event.op
        elif event.kind == "free":
            block = blocks.pop(event.key, None)
            if block is not None:
                count(category_of.pop(event.key, UNCATEGORIZED), -block.size)
            model.free(block)
        elif event.kind == "reset":
            model.reset_peak()
            at_peak = dict(live)
        elif event.kind == "op" and event.op.split(".")[0] in CUBLAS_OPS and workspace_bytes:
            thread = thread_of(event.stage)
            if thread not in threads_with_workspace:
                threads_with_workspace.add(thread)
                # held by the handle's workspace map for the process's life
                allocated(model.malloc(workspace_bytes), CUBLAS_WORKSPACE)
    return ReplayResult(model.stats.peak_allocated_bytes, model.stats.peak_reserved_bytes,
                        len(threads_with_workspace), workspace_bytes, model.stats,
                        {name: nbytes for name, nbytes in at_peak.items() if nbytes})


def workspace_from_environment(capability: tuple[int, int] | None) -> int:
    """cuBLAS's workspace as this process would size it: CUBLAS_WORKSPACE_CONFIG, else the default for
    `capability`."""
    return cublas_workspace_bytes(capability, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
