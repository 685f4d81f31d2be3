"""Memory measurement: an exact live-tensor-bytes tracker for the CPU and fake tensors (CUDA's own peak statistics:
bench.measure.cuda_peak).

Memory is measured in its own pass: nothing here runs while steps are timed.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from bench.core import memory_categories
from bench.measure import mode_aside, step_repeat
from bench.measure.dispatch_modes import CompiledCodeMode
from bench.measure.memory_events import MemoryEvent, TimelinePoint
from bench.measure.storage_table import StorageInfo, StorageTable

STAGES = ("setup", "forward", "backward", "optimizer")


# Operators that read a tensor's metadata and make no tensor, by id: an OpOverload hashes in Python, and this is
# asked of every operator
_METADATA_OPS = frozenset({id(torch.ops.prim.device.default)})


class LiveTensorTracker(CompiledCodeMode):
    """Counts the bytes of every live tensor storage on one device, exactly, op by op.

    Storages are registered when first seen, as an operator's output or input, or through `track()` for
    tensors that existed before the tracker was entered (parameters, the batch, optimizer state). A weak
    reference to each storage takes its bytes off the count when the storage is freed. The count is of
    storages, so views and in-place results are not counted twice; a wrapper tensor subclass (torchao's 8-bit
    optimizer state) counts as the tensors inside it, not as its face's dtype. Allocations made inside a kernel
    that never become a tensor (workspaces) are not seen: the figure is live *tensor* bytes.

    A storage resized in place (`UntypedStorage.resize_`: FSDP2 frees each unit's all-gathered parameters with
    `resize_(0)` after its forward and reallocates them with `resize_(n)` before its backward, the storage object
    living on) counts its new bytes: the old block freed, a new one allocated, as CUDA's allocator does.

    `stage` is set by the caller (forward/backward/optimizer); each storage is filed under a category: the one
    given to `track()`, else the one the code that made it declared (`bench.core.memory_categories.allocating`: the
    communication buffers of sharded training), else the stage it was created in; `recategorize()` (and
    `memory_categories.file_as`) files it anew. Inside `memory_categories.one_fused_kernel()` nothing new is
    registered or counted: the operators there emulate a fused kernel that updates existing storages in place.

    With `record_events`, `events` logs every allocation and free in the order they happened (exact bytes, not
    rounded), every operator and the peak resets, from the tracker's start: `bench.measure.cuda_allocator` replays it
    through a model of CUDA's caching allocator.
    """

    def __init__(self, device: str = "cpu", record_timeline: bool = False, block_bytes: int = 1,
                 record_events: bool = False):
        super().__init__()
        self.device = torch.device(device).type
        # each storage counts as its bytes rounded up to a multiple of block_bytes (512 models CUDA's allocator)
        self.block_bytes = block_bytes
        self.record_timeline = record_timeline
        self.stage = "setup"
        self._storages = StorageTable()
        # the weak reference that tells of each live storage's release (a callback runs only while its reference
        # lives), by id; each one drops itself when it has told, so a pass's bookkeeping is its live storages'
        self._refs: dict[int, weakref.ref] = {}
        self.live_bytes = 0
        self.live_by_category: dict[str, int] = {}
        self.peak_bytes = 0
        self.peak_stage = "setup"
        self.peak_by_category: dict[str, int] = {}
        self.timeline: list[TimelinePoint] = []
        self._ops = 0
        self.record_events = record_events
        self.events: list[MemoryEvent] = []
        self._keys = 0
        # the module running now, recorded with each alloc (set by bench.measure.snapshot.ModuleScope)
        self.module_of: Callable[[], str] | None = None
        self.window_end_categories: dict[int, str] = {}  # storage key -> category, at `close_window()`
        # (category, the dtypes it is for or None: all) declared by `memory_categories.allocating`, innermost last
        self._allocating: list[tuple[str, frozenset | None]] = []
        self.entered = 0  # how many times this tracker is on the dispatch mode stack now
        # the buffers an operator holds only while it runs, beyond its outputs, in allocation order, as (bytes,
        # category) (cuDNN's convolution workspace, a reduction's scratch: `bench.measure.op_scratch`), from the
        # operator and its arguments; None: none counted
        self.op_workspace: Callable[[Any, tuple], tuple[tuple[int, str], ...]] | None = None
        self._set_aside: list = []  # per entry, the mode below it taken off the stack meanwhile (`mode_aside`)

    # in-place storage resizes --------------------------------------------------------------------------
    def __enter__(self):
        if self not in _RESIZE_WATCHERS:
            _RESIZE_WATCHERS.append(self)
        _patch_storage_resize()
        memory_categories.listen(self)
        entered = super().__enter__()
        self.entered += 1
        self._set_aside.append(mode_aside.set_aside_below(self))
        return entered

    def __exit__(self, *exc):
        mode_aside.put_back_below(self, self._set_aside.pop())
        self.entered -= 1
        if self in _RESIZE_WATCHERS:
            _RESIZE_WATCHERS.remove(self)
        memory_categories.stop_listening(self)
        return super().__exit__(*exc)

    # categories declared by the code that allocates (bench.core.memory_categories) -------------------------
    def push_allocation_category(self, category: str, dtypes: frozenset | None = None) -> None:
        self._allocating.append((category, dtypes))

    def pop_allocation_category(self) -> None:
        self._allocating.pop()

    def _category_of_output(self, t: torch.Tensor) -> str:
        """The category of a storage an operator makes now: the innermost declared one that is for its dtype, else
        the stage."""
        for category, dtypes in reversed(self._allocating):
            if dtypes is None or t.dtype in dtypes:
                return category
        return self.stage

    def _resized(self, st: torch.UntypedStorage, nbytes: int) -> None:
        """A tracked storage now holds `nbytes`: the new block allocated (with a new key), then the old one freed,
        as `resize_` copies into new memory before it lets the old go; to 0 bytes, only the free."""
        info = self._storages.get(st)
        if info is None or self.storage_bytes(nbytes) == info.nbytes:
            return
        old_key, old_bytes = info.key, info.nbytes
        if nbytes:
            self._keys += 1
            info.key = self._keys
            if self.record_events:
                module = self.module_of() if self.module_of else ""
                self.events.append(MemoryEvent("alloc", info.key, nbytes, self.stage, module=module,
                                               category=info.category))
        else:
            info.key = 0
        if self.record_events and old_key:
            self.events.append(MemoryEvent("free", old_key, stage=self.stage, category=info.category))
        info.nbytes = self.storage_bytes(nbytes)
        self.live_bytes += info.nbytes - old_bytes
        self.live_by_category[info.category] += info.nbytes - old_bytes
        self._update_peak("resize_")

    # registration -------------------------------------------------------------------------------------
    def track(self, tensors: Iterable[torch.Tensor | None], category: str) -> None:
        """Registers tensors that already exist, under `category` (e.g. "params", "batch")."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._register(t, category)
        self._update_peak("")

    def made_now(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Registers tensors as an operator's outputs made now (filed as such; `memory_categories.made_now`)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._register_output(t)
        self._update_peak("")

    def _register_output(self, t: torch.Tensor) -> None:
        """Registers `t` as an operator's output made now: under its declared category, else the stage's."""
        self._register(t, self._category_of_output(t) if self._allocating else self.stage)

    def _register(self, t: torch.Tensor, category: str) -> None:
        if type(t) is FakeTensor:  # most tensors of a prediction: neither a DTensor nor a wrapper, never meta
            if t.device.type != self.device:
                return
        else:
            # a DTensor (FSDP's sharded parameters): this rank's shard is what lives here
            t = getattr(t, "_local_tensor", t)
            if is_traceable_wrapper_subclass(t):
                # a wrapper (torchao's 8-bit optimizer state: uint8 codes and float32 scales behind a float32 face)
                # holds no data of its own: its storage reports the face's bytes; the tensors inside are what lives
                for inner in _inner_tensors(t):
                    self._register(inner, category)
                return
            # a fake tensor is never meta but on the meta device (which the first test skips), and asking it
            # `is_meta` dispatches an operator through every mode (~80 us, once per tensor of a full-size step's
            # ~70,000)
            if t.device.type != self.device or (self.device != "meta" and not isinstance(t, FakeTensor)
                                                and t.is_meta):
                return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse or opaque tensors have no storage
            return
        by_id = self._storages.by_id
        storage_id = id(st)
        if storage_id in by_id:
            return
        self._keys += 1
        nbytes = st.nbytes()
        info = StorageInfo(-(-nbytes // self.block_bytes) * self.block_bytes, category, self._keys)
        if self.record_events:
            module = self.module_of() if self.module_of else ""
            self.events.append(MemoryEvent("alloc", info.key, nbytes, self.stage, module=module, category=category))
        by_id[storage_id] = info
        self.live_bytes += info.nbytes
        self.live_by_category[category] = self.live_by_category.get(category, 0) + info.nbytes
        ref = weakref.ref(st, lambda ref, info=info, storage_id=storage_id: self._released(ref, info, storage_id))
        self._refs[id(ref)] = ref

    def storage_bytes(self, nbytes: int) -> int:
        """The bytes one storage counts for: exact, or rounded up to `block_bytes`."""
        return -(-nbytes // self.block_bytes) * self.block_bytes

    def relabel_live(self, categories: Iterable[str], category: str) -> None:
        """Files every live storage now under one of `categories` under `category` instead."""
        old = set(categories)
        for info in list(self._storages.values()):
            if info.category in old:
                self.live_by_category[info.category] -= info.nbytes
                self.live_by_category[category] = self.live_by_category.get(category, 0) + info.nbytes
                info.category = category

    def _released(self, ref: weakref.ref, info: StorageInfo, storage_id: int) -> None:
        self._refs.pop(id(ref), None)
        self._storages.by_id.pop(storage_id, None)  # before the id can name another storage
        self._freed(info)

    def _freed(self, info: StorageInfo) -> None:
        if self.record_events and info.key:  # key 0: resized to nothing, its block already freed
            self.events.append(MemoryEvent("free", info.key, stage=self.stage, category=info.category))
        self.live_bytes -= info.nbytes
        self.live_by_category[info.category] -= info.nbytes

    def recategorize(self, tensors: Iterable[torch.Tensor | None], category: str) -> None:
        """Files already-registered tensors under a new category (e.g. gradients once they are `.grad`)."""
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type != self.device:
                continue
            t = getattr(t, "_local_tensor", t)  # a DTensor: its shard on this rank
            if is_traceable_wrapper_subclass(t):  # a wrapper: the tensors inside it (see `_register`)
                self.recategorize(_inner_tensors(t), category)
                continue
            info = self._storages.get(t.untyped_storage())
            if info is None:
                self._register(t, category)
            elif info.category != category:
                self.live_by_category[info.category] -= info.nbytes
                self.live_by_category[category] = self.live_by_category.get(category, 0) + info.nbytes
                info.category = category

    # peak ---------------------------------------------------------------------------------------------
    def reset_peak(self) -> None:
        """Starts a new measurement window: the peak restarts from what is live now."""
        self.peak_bytes = self.live_bytes
        self.peak_stage = self.stage
        self.peak_by_category = dict(self.live_by_category)
        self.timeline = []
        self._ops = 0
        if self.record_events:
            self.events.append(MemoryEvent("reset", stage=self.stage))

    def close_window(self) -> None:
        """Ends the measured step: the timeline stops, and with `record_events` the log gets an "end" event and
        `window_end_categories` the category of every storage live now (a snapshot files each storage under it)."""
        self.record_timeline = False
        if self.record_events:
            self.events.append(MemoryEvent("end", stage=self.stage))
            self.window_end_categories = {info.key: info.category for info in self._storages.values()}

    def log_repeated_step(self, start: int, end: int, stage: str) -> None:
        """Logs the step after the one logged at `events[start:end]`, in place of running it, as that step repeated
        (`bench.measure.step_repeat`), and ends in `stage` (that step's last); the peak, its stage and its bytes by
        category are that log's, counted event by event from what is live now."""
        live = {info.key: (info.nbytes, info.category) for info in self._storages.values() if info.key}
        repeated = step_repeat.repeated_step(self.events, start, end, self._keys + 1)
        self._keys += sum(event.kind == "alloc" for event in repeated)
        self.events.extend(repeated)
        self.peak_bytes, self.peak_stage, self.peak_by_category = step_repeat.log_peak(repeated, live,
                                                                                       self.storage_bytes)
        self.stage = stage

    def _update_peak(self, op: str) -> None:
        self._note_peak()
        if self.record_timeline and op:
            self.timeline.append(TimelinePoint(self._ops, self.stage, op, self.live_bytes))
        self._ops += 1

    def _note_peak(self) -> None:
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.peak_stage = self.stage
            self.peak_by_category = dict(self.live_by_category)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if id(func) in _METADATA_OPS:
            # a fake tensor answers `.device` through the dispatcher: asking it is no use of the tensor, and
            # registering it here would file a tensor that `track()` is about to register under "untracked".
            # C++ asks it of a fake tensor several times an operator (two thirds of a fake step's dispatches): the
            # answer is the one FakeTensorMode gives (its `_device_handler`: the tensor's `device` property), given
            # here rather than through every mode below
            if type(args[0]) is FakeTensor:
                return args[0].device
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        if self._allocating and self._allocating[-1][0] == memory_categories.FUSED_KERNEL:
            return func(*args, **kwargs)  # one kernel's arithmetic: its intermediates are no memory (see there)
        self._register_inputs(args)
        if kwargs:
            self._register_inputs(kwargs.values())
        if self.record_events:
            self.events.append(MemoryEvent("op", stage=self.stage, op=func.__name__))
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            if not self._seen(out):
                self._register_output(out)
        else:
            for t in _tensors_in((out,)):
                if not self._seen(t):
                    self._register_output(t)
        if self.op_workspace is not None:
            held = self.op_workspace(func, args)
            if held:
                self._held_while_running(held, func.__name__)
        self._update_peak(func.__name__)
        return out

    def _held_while_running(self, buffers: tuple[tuple[int, str], ...], op: str) -> None:
        """Buffers (bytes, category) `op` allocates after its outputs and frees before it returns (a workspace): at
        the peak if they make one, then gone."""
        held = [self.allocated_unseen(nbytes, category, f"{op} workspace") for nbytes, category in buffers]
        self._note_peak()
        for info in reversed(held):
            self._freed(info)

    def allocated_unseen(self, nbytes: int, category: str, module: str) -> StorageInfo:
        """A storage of `nbytes` that no tensor holds (a kernel's workspace, an intermediate of a replayed call:
        bench.measure.call_replay), counted and logged as allocated now; `_freed` ends it."""
        self._keys += 1
        info = StorageInfo(self.storage_bytes(nbytes), category, self._keys)
        if self.record_events:
            self.events.append(MemoryEvent("alloc", info.key, nbytes, self.stage, module=module, category=category))
        self.live_bytes += info.nbytes
        self.live_by_category[category] = self.live_by_category.get(category, 0) + info.nbytes
        return info

    def _register_inputs(self, values: Iterable) -> None:
        """Registers the tensors among an operator's arguments that are not yet (in lists and tuples at any depth,
        in order: `_tensors_in`), as "untracked"."""
        for value in values:
            if isinstance(value, torch.Tensor):
                if not self._seen(value):
                    self._register(value, "untracked")
            elif isinstance(value, (list, tuple)):
                self._register_inputs(value)

    def _seen(self, t: torch.Tensor) -> bool:
        """Whether `t` is a fake tensor whose storage is registered already, for which `_register` (this class's
        and its subclasses') does nothing: asked first, it spares those calls for most tensors an operator takes,
        and for its views and in-place results."""
        if type(t) is not FakeTensor:
            return False
        try:
            return id(t.untyped_storage()) in self._storages.by_id
        except (RuntimeError, NotImplementedError):  # sparse or opaque tensors have no storage
            return False


def _tensors_in(values: Iterable) -> Iterable[torch.Tensor]:
    """The tensors among an operator's arguments or results, in lists and tuples at any depth (what an aten operator
    takes and returns; torch's pytree flattening, which looks for every registered container, cost a full-size
    step seconds)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors_in(value)


_RESIZE_WATCHERS: list[LiveTensorTracker] = []  # the trackers entered now, told of each storage resize


def _patch_storage_resize() -> None:
    """Wraps `torch.UntypedStorage.resize_` once per process so that each entered tracker hears of the new size
    (a storage's bytes are otherwise read once, when the tracker first sees it)."""
    original = torch.UntypedStorage.resize_
    if getattr(original, "_membench_watched", False):
        return

    def resize_(storage, size):
        out = original(storage, size)
        for tracker in list(_RESIZE_WATCHERS):
            tracker._resized(storage, storage.nbytes())
        return out

    resize_._membench_watched = True
    torch.UntypedStorage.resize_ = resize_


def _inner_tensors(wrapper: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a wrapper tensor subclass is made of (`__tensor_flatten__`), which hold its data."""
    names, _ = wrapper.__tensor_flatten__()
    return [getattr(wrapper, name) for name in names]
