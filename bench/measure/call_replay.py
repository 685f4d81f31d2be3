"""Call replay: a function of fake tensors traced once under the live-tensor tracker for each layout of its inputs,
its operators, allocations and frees logged again for every later call of that layout, and its output made without
running its operators.

torchao's NF4 dequantisation (`NF4Tensor.get_original_weight`: about twenty operators a weight, run in the forward,
again in a checkpointed layer's recompute and again in backward) was a third of a QLoRA trace; its memory is a
function of the weight's layout alone. What a replayed call logs is what the call logged when it ran: the same
operators, the same allocations and frees in the same order with the same bytes, categories, stage and module, the
peak counted after each operator's outputs as the tracker counts it; its output is a fake tensor of the same shape,
strides, dtype and storage, registered as the call's surviving allocation.

A call is replayed only where that is sure to be so: its inputs fake tensors that need no gradient, every dispatch
mode on the stack the recording live-tensor tracker or the fake mode (no operator counter, no other tracker), no
timeline, and the first call of the layout, traced for real, found self-contained (nothing but its operators'
outputs allocated, nothing freed that it did not allocate, one allocation left at its end: its output's storage).
Otherwise the call runs as it would. MEMBENCH_FULL_TRACE=1 runs every call
(tests_cuda_fake/test_call_replay_fake_cuda.py compares the logs).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Callable, Hashable, Iterator, NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from bench.core import job_environment, memory_categories
from bench.measure.breakdown import CategorizedTracker
from bench.measure.memory import LiveTensorTracker
from bench.measure.memory_events import MemoryEvent
from bench.measure.sdpa_kernel import SdpaCalls, SdpaKernelChoice
from bench.measure.storage_table import StorageInfo


class Recording(NamedTuple):
    """What one call did to the tracker, in order: ("op", name), ("alloc", bytes, category, whether a "category"
    event came before it: CategorizedTracker's) or ("free", index of its alloc among the call's allocs); `output`:
    the index of the alloc its output's storage is; `layout`: the output's (shape, strides, storage offset, dtype,
    storage bytes)."""

    steps: tuple
    output: int
    layout: tuple


# the trackers a call is replayed for: what they log of a call is what `_replay` logs (a subclass that logs more,
# or counts otherwise, FakeAllocator's out-of-memory check among them, is not one)
_REPLAYING = (LiveTensorTracker, CategorizedTracker)
# function modes that act on attention calls alone (any other, a counter of every call among them, sees the operators)
_ATTENTION_ONLY = (SdpaKernelChoice, SdpaCalls)
_REFUSED = object()  # a layout whose first call was not self-contained: every call of it runs
# per tracker, layout key -> Recording or _REFUSED
_MEMO: "weakref.WeakKeyDictionary[LiveTensorTracker, dict]" = weakref.WeakKeyDictionary()


def recording_tracker(tensors: tuple) -> LiveTensorTracker | None:
    """The live-tensor tracker a call of `tensors` may be replayed under, or None: fake tensors needing no gradient,
    the dispatch modes on the stack one event-logging tracker of `_REPLAYING` without a timeline and fake modes, no
    function mode but those that only choose or count attention kernels, and MEMBENCH_FULL_TRACE unset."""
    if not all(type(t) is FakeTensor and not t.requires_grad for t in tensors):
        return None
    if any(type(mode) not in _ATTENTION_ONLY for mode in _get_current_function_mode_stack()):
        return None
    trackers = []
    for mode in _get_current_dispatch_mode_stack():
        if type(mode) in _REPLAYING:
            trackers.append(mode)
        elif not isinstance(mode, FakeTensorMode):
            return None
    if len(trackers) != 1 or job_environment.full_trace_forced():
        return None
    tracker = trackers[0]
    return tracker if tracker.record_events and not tracker.record_timeline else None


def replayed_call(tracker: LiveTensorTracker, key: Hashable, call: Callable[[], torch.Tensor],
                  inputs: tuple) -> torch.Tensor:
    """`call()` under `tracker`, replayed where a call of the same `key` (the inputs' layout) was recorded; the
    first call of a key runs and is recorded. `inputs`: the fake tensors it reads (their storages' registration is
    part of the key: a call that registers an input logs more)."""
    registered = tuple(t.untyped_storage() in tracker._storages for t in inputs)
    full_key = (key, registered, tracker.stage, tuple(tracker._allocating), tracker.block_bytes,
                tracker.op_workspace is not None)
    memo = _MEMO.setdefault(tracker, {})
    found = memo.get(full_key)
    if found is _REFUSED:
        return call()
    if found is not None:
        return _replay(tracker, found)
    output, recording = _record(tracker, call)
    memo[full_key] = recording if recording is not None else _REFUSED
    return output


def _record(tracker: LiveTensorTracker, call: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Recording | None]:
    """`call()`'s output, and what it did to the tracker (None where it was not self-contained, see the module)."""
    start, first_key, ops = len(tracker.events), tracker._keys, tracker._ops
    stage, module = tracker.stage, tracker.module_of() if tracker.module_of else ""
    output = call()
    events = tracker.events[start:]
    if type(output) is not FakeTensor or tracker._ops - ops != sum(event.kind == "op" for event in events):
        return output, None
    output_info = tracker._storages.get(output.untyped_storage())
    allocs: dict[int, int] = {}  # event key -> index among the call's allocs
    freed: set[int] = set()
    steps = []
    for index, event in enumerate(events):
        if event.stage != stage:
            return output, None
        if event.kind == "category":  # CategorizedTracker's, just before the alloc it files
            following = events[index + 1] if index + 1 < len(events) else None
            if following is None or following.kind != "alloc" or following.key != event.key:
                return output, None
        elif event.kind == "op":
            steps.append(("op", event.op))
        elif event.kind == "alloc":
            if event.key <= first_key or event.module != module or not steps:
                return output, None
            allocs[event.key] = len(allocs)
            steps.append(("alloc", event.nbytes, event.category, index > 0 and events[index - 1].kind == "category"))
        elif event.kind == "free" and event.key in allocs:
            freed.add(event.key)
            steps.append(("free", allocs[event.key]))
        else:
            return output, None
    left = set(allocs) - freed
    if output_info is None or left != {output_info.key}:
        return output, None
    storage = output.untyped_storage()
    layout = (tuple(output.shape), output.stride(), output.storage_offset(), output.dtype, storage.nbytes())
    return output, Recording(tuple(steps), allocs[output_info.key], layout)


def _replay(tracker: LiveTensorTracker, recording: Recording) -> torch.Tensor:
    """The recorded call logged again on `tracker` (see the module), and its output made."""
    shape, stride, offset, dtype, nbytes = recording.layout
    tracker.push_allocation_category(memory_categories.FUSED_KERNEL)  # made unseen; registered at its alloc
    try:
        extent = 1 + sum((size - 1) * step for size, step in zip(shape, stride)) if all(shape) else 0
        if offset == 0 and extent * dtype.itemsize == nbytes:  # the usual output: one operator, not two
            output = torch.empty_strided(shape, stride, dtype=dtype, device=tracker.device)
        else:
            output = torch.empty(nbytes // dtype.itemsize, dtype=dtype, device=tracker.device).as_strided(
                shape, stride, offset)
    finally:
        tracker.pop_allocation_category()
    stage, module = tracker.stage, tracker.module_of() if tracker.module_of else ""
    made: list[StorageInfo | None] = []
    pending = None  # the operator whose outputs are logged and whose peak is not yet counted
    for step in recording.steps:
        if step[0] == "op":
            if pending is not None:
                tracker._update_peak(pending)
            tracker.events.append(MemoryEvent("op", stage=stage, op=step[1]))
            pending = step[1]
        elif step[0] == "alloc":
            if len(made) == recording.output:
                tracker._register(output, step[2])
                made.append(None)
                continue
            info = tracker.allocated_unseen(step[1], step[2], module)
            if step[3]:  # before its alloc, as CategorizedTracker files a storage
                tracker.events.insert(len(tracker.events) - 1, MemoryEvent("category", info.key, stage=stage,
                                                                           op=step[2]))
            made.append(info)
        else:
            if pending is not None:
                tracker._update_peak(pending)
                pending = None
            tracker._freed(made[step[1]])
    if pending is not None:
        tracker._update_peak(pending)
    return output


@contextlib.contextmanager
def replayed_methods(calls: list[tuple[type, str, Callable[[object], tuple[Hashable, tuple]]]]) -> Iterator[None]:
    """Inside, each `owner.name(self)` of `calls` ((owner, name, layout): a strategy's `replayable_calls()`) is
    replayed per layout where `recording_tracker` allows (see the module); `layout(self)` gives the call's key and
    the fake tensors it reads. Restored on exit."""
    with contextlib.ExitStack() as stack:
        for owner, name, layout in calls:
            stack.enter_context(_replayed_method(owner, name, layout))
        yield


@contextlib.contextmanager
def _replayed_method(owner: type, name: str, layout: Callable[[object], tuple[Hashable, tuple]]) -> Iterator[None]:
    original = owner.__dict__[name]

    @functools.wraps(original)
    def method(self):
        if torch.compiler.is_compiling():
            return original(self)
        key, inputs = layout(self)
        tracker = recording_tracker(inputs)
        if tracker is None:
            return original(self)
        return replayed_call(tracker, (owner, name, key), lambda: original(self), inputs)

    setattr(owner, name, method)
    try:
        yield
    finally:
        setattr(owner, name, original)
