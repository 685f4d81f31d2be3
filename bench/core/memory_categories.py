"""Who made a tensor, told to the live-tensor trackers by the code that makes it.

The exact tracker (bench.measure.memory.LiveTensorTracker) files each storage under the stage it was created in
(forward, backward, optimizer); some buffers have a kind of their own that their stage does not say. The buffers of
sharded training's collectives are the case here: FSDP2's all-gather output and reduce-scatter input and output,
made in the forward or backward, and DistributedDataParallel's gradient buckets, made in its forward's bucket
rebuild. The code that makes them (a strategy, which may not import bench.measure) says so here, and every tracker
entered now listens: `allocating(category)` around the allocation files what operators create inside it under
`category`; `file_as(tensors, category)` files tensors that already exist.

Only the thread that entered a tracker is seen by it (a TorchDispatchMode is thread-local): what a collective's own
threads allocate (gloo's workers) never becomes a tensor of the step and is not counted anywhere.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Protocol

COMMUNICATION = "communication"  # the buffers a collective sends or receives (bench.measure.breakdown's column)
WEIGHTS = "params"  # the tracker's category of the model's weights
UNIFIED_MEMORY = "unified_memory"  # CUDA unified memory (cudaMallocManaged): bitsandbytes' paged optimizer state
# categories whose storages CUDA's caching allocator never serves: its statistics (and its model) leave them out
OUTSIDE_ALLOCATOR = frozenset({UNIFIED_MEMORY})
# a mixture-of-experts layer's own activations, declared by the workload that builds it
# (workloads/framework/hf_moe.py): what its router makes (logits, probabilities, top-k choices) and what its experts'
# dispatch makes (the tokens' copies sorted by expert, the grouped products, the results put back in token order);
# both are activations
MOE_ROUTER = "moe_router"
MOE_DISPATCH = "moe_dispatch"
# what an operator holds only while it runs, beyond its outputs (bench.measure.op_scratch): cuDNN's convolution
# workspace, the reduction kernel's partial results and semaphores; "other" in the breakdown
CUDNN_WORKSPACE = "cudnn_workspace"
REDUCTION_SCRATCH = "reduction_scratch"
HELD_WHILE_RUNNING = frozenset({CUDNN_WORKSPACE, REDUCTION_SCRATCH})
FUSED_KERNEL = "fused_kernel"  # not a category of storage: inside, operators are one kernel's arithmetic (see above)


class Listener(Protocol):
    def push_allocation_category(self, category: str, dtypes: frozenset | None = None) -> None: ...

    def pop_allocation_category(self) -> None: ...

    def recategorize(self, tensors: Iterable, category: str) -> None: ...

    def made_now(self, tensors: Iterable) -> None: ...


_LISTENERS: list[Listener] = []  # the trackers entered now


def listen(listener: Listener) -> None:
    if listener not in _LISTENERS:
        _LISTENERS.append(listener)


def stop_listening(listener: Listener) -> None:
    if listener in _LISTENERS:
        _LISTENERS.remove(listener)


def listening() -> bool:
    """Whether any tracker listens now (a caller may skip gathering tensors when none does)."""
    return bool(_LISTENERS)


@contextlib.contextmanager
def allocating(category: str, dtypes: Iterable[Any] | None = None) -> Iterator[None]:
    """Inside, every listening tracker files the storages that operators create under `category` (not the stage's);
    with `dtypes` (torch dtypes), only those of tensors of these dtypes (the others as they would be filed outside)."""
    listeners = list(_LISTENERS)
    only = frozenset(dtypes) if dtypes is not None else None
    for listener in listeners:
        listener.push_allocation_category(category, only)
    try:
        yield
    finally:
        for listener in listeners:
            listener.pop_allocation_category()


@contextlib.contextmanager
def one_fused_kernel() -> Iterator[None]:
    """Inside, the operators emulate one fused kernel that updates existing tensors in place: every listening tracker
    registers nothing they make or read and counts no peak (the kernel's intermediates live in its registers)."""
    with allocating(FUSED_KERNEL):
        yield


def made_now(tensors: Iterable) -> None:
    """Every listening tracker counts `tensors` from now on, as what an operator just made: the outputs of a fused
    kernel whose arithmetic ran inside `one_fused_kernel()` (a compiled graph's,
    `strategies/framework/inductor_plan.py`)."""
    tensors = list(tensors)
    for listener in list(_LISTENERS):
        listener.made_now(tensors)


def file_as(tensors: Iterable, category: str) -> None:
    """Every listening tracker files the storages of `tensors` under `category` from now on."""
    if not _LISTENERS:
        return
    tensors = list(tensors)
    for listener in list(_LISTENERS):
        listener.recategorize(tensors, category)
