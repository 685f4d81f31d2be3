"""Writing memory snapshots in PyTorch's format (`torch.cuda.memory._snapshot()`), one per case: from the exact
tracker's event log (the CPU, the fake engines), from the caching-allocator model's replay of that log (CUDA
predictions), or recorded by CUDA itself (`torch.cuda.memory._record_memory_history`).

PyTorch's viewer (https://pytorch.org/memory_viz, or `torch.cuda._memory_viz`) opens the pickles. Each allocation's
frames name, innermost first, the operator (`operator:0:aten::convolution`), the module whose forward ran it
(`module:0:layer1.0.conv1`; `ModuleScope` follows it) and the stage of the step (`stage:0:forward`). A trace written
here covers the measured step only: it opens with an "alloc" for every storage live when the step began (and, from
the allocator model, a "segment_alloc" for every segment reserved then; their count is "membench"["prelude_events"]),
so its running sum is the live memory and its maximum the row's peak (`bench.core.snapshots.replay_peaks`); it
ends with a "snapshot" event of category "unknown", which PyTorch's viewer needs (`_TraceWriter.close`), and the
pickle is protocol 4, the newest the viewer reads (tests/test_memory_viz.py draws these files in it).
Each alloc also says its breakdown `category` (weights, gradients, optimizer_state, activations, temporaries, batch:
`bench.measure.breakdown`'s columns), `module`, `stage` and `op`, which the HTML report draws.

Limitations: the tracker's addresses are made up (one after the other, never reused: storages have no address on
fake tensors; one made-up segment spans them all), so only the model's snapshots say anything about fragmentation;
a predicted trace's sizes are the allocator's blocks (what `memory_allocated` counts), where CUDA's own trace
records the requested bytes; a storage's category is the one it had when freed or when the step ended (a gradient
is one from its creation).
"""

from __future__ import annotations

import contextlib
import pickle
import re
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_flatten

from bench.core.atomic import atomic_path
from bench.core.filenames import bounded_name
from bench.measure import breakdown, cuda_allocator, memory
from bench.core.snapshots import SNAPSHOT_SUFFIX, plain

CATEGORY_OF_COLUMN = {
    "peak_params_bytes": "weights", "peak_grads_bytes": "gradients", "peak_optimizer_bytes": "optimizer_state",
    "peak_activations_bytes": "activations", "peak_temp_bytes": "temporaries", "peak_batch_bytes": "batch",
    "peak_communication_bytes": "communication",
}
# the category PyTorch's viewer gives an allocation without one (`_TraceWriter.close` says why a trace names it)
VIEWER_UNKNOWN_CATEGORY = "unknown"
# PyTorch's viewer reads pickle protocols 2 to 4 only ("Unhandled version 5"); Python 3.14's default is 5
PICKLE_PROTOCOL = 4
ADDRESS_BASE = 1 << 32  # the first made-up address of a tracker snapshot
ALIGNMENT = 512


def category_of(tracker_category: str) -> str:
    """A tracker category (params, grads, forward, ...) as the snapshot's breakdown category."""
    return CATEGORY_OF_COLUMN[breakdown.CATEGORY_COLUMN.get(tracker_category, breakdown.TEMP_COLUMN)]


class ModuleScope:
    """While entered, the tracker's `module_of()` names the module an allocation is made for: the innermost module
    whose forward is running (its qualified name in `root`, else its class name), from global forward pre- and
    post-hooks; in the backward, the module whose forward made the autograd node running now (the post-hook writes
    its name into the metadata of its outputs' nodes), with the node's name. Hooks and metadata change no tensor.
    Does nothing unless the tracker records events."""

    METADATA_KEY = "membench_module"

    def __init__(self, root: torch.nn.Module, tracker: memory.LiveTensorTracker):
        self.tracker = tracker
        self.names = {id(module): name or type(module).__name__ for name, module in root.named_modules()}
        self.stack: list[tuple[int, str, int | None]] = []  # (id, name, first node number) of running forwards
        self.handles: list = []

    def __enter__(self) -> "ModuleScope":
        if self.tracker.record_events:
            from torch.nn.modules import module as nn_module

            self.handles = [nn_module.register_module_forward_pre_hook(self._entered),
                            # always_call: a forward that raises still leaves (checkpoint's recomputation stops
                            # early by raising, and its modules would otherwise name every later allocation)
                            nn_module.register_module_forward_hook(self._left, always_call=True)]
            self.tracker.module_of = self.current
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.stack = [], []
        self.tracker.module_of = None

    def current(self) -> str:
        """The module an allocation made now is for ("" when none is known)."""
        if self.stack:
            return self.stack[-1][1]
        node = torch._C._current_autograd_node() if hasattr(torch._C, "_current_autograd_node") else None
        if node is None:
            return ""
        module = node.metadata.get(self.METADATA_KEY)
        return f"{module} ({node.name()})" if module else node.name()

    def _name(self, module: torch.nn.Module) -> str:
        return self.names.get(id(module), type(module).__name__)

    def _entered(self, module: torch.nn.Module, args: Any) -> None:
        self.stack.append((id(module), self._name(module), _sequence_number()))

    def _left(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        began = None
        while self.stack:
            entry = self.stack.pop()
            if entry[0] == id(module):
                began = entry[2]
                break
        name = self._name(module)
        # every node this forward made, not only its outputs' (a Linear on a 3-d input ends in a view, and its
        # MmBackward0 lies behind it): from the outputs back to the nodes made before the forward began; an inner
        # module's post-hook ran first, so its nodes keep the inner name
        pending = [getattr(v, "grad_fn", None) for v in tree_flatten(output)[0] if isinstance(v, torch.Tensor)]
        seen: set[int] = set()
        while pending:
            node = pending.pop()
            if node is None or id(node) in seen or (began is not None and node._sequence_nr() < began):
                continue
            seen.add(id(node))
            if began is None:  # no sequence numbers: the outputs' nodes alone, as before
                node.metadata.setdefault(self.METADATA_KEY, name)
                continue
            if "AccumulateGrad" in node.name():
                continue
            node.metadata.setdefault(self.METADATA_KEY, name)
            pending.extend(next_node for next_node, _ in node.next_functions)


def _sequence_number() -> int | None:
    """The number the next autograd node made on this thread gets (None where torch does not say)."""
    getter = getattr(getattr(torch._C, "_autograd", None), "_get_sequence_nr", None)
    return getter() if getter is not None else None


def frames(op: str, module: str, stage: str) -> list[dict[str, Any]]:
    """An allocation's frames, innermost first: its operator, its module and its stage."""
    return [{"filename": "operator", "line": 0, "name": f"aten::{op}" if op else "(no operator)"},
            {"filename": "module", "line": 0, "name": module or "(no module)"},
            {"filename": "stage", "line": 0, "name": stage or "setup"}]


def _window(events: list[memory.MemoryEvent]) -> tuple[int, int]:
    """(index of the last peak reset, index of the first "end" after it): the measured step in the log."""
    reset = max((i for i, e in enumerate(events) if e.kind == "reset"), default=-1)
    end = next((i for i in range(reset + 1, len(events)) if events[i].kind == "end"), len(events))
    return reset, end


def _final_categories(events: list[memory.MemoryEvent], end: int, at_end: dict[int, str]) -> dict[int, str]:
    """Each storage's category: when it was freed (before `end`), else when the window closed, else its first."""
    categories = {e.key: e.category for e in events[:end] if e.kind == "alloc"}
    categories.update(at_end)
    categories.update({e.key: e.category for e in events[:end] if e.kind == "free"})
    return categories


class _TraceWriter:
    """The device trace under construction: alloc and free events with their frames and category."""

    def __init__(self, categories: dict[int, str]):
        self.trace: list[dict[str, Any]] = []
        self.categories = categories

    def alloc(self, key: int, address: int, size: int, event: memory.MemoryEvent, op: str) -> dict[str, Any]:
        entry = {"action": "alloc", "addr": address, "size": size, "stream": 0, "time_us": len(self.trace),
                 "frames": frames(op, event.module, event.stage),
                 "category": category_of(self.categories.get(key, event.category)), "module": event.module,
                 "stage": event.stage or "setup", "op": op}
        self.trace.append(entry)
        return entry

    def free(self, entry: dict[str, Any], size: int | None = None) -> None:
        for action in ("free_requested", "free_completed"):
            self.trace.append({**entry, "action": action, "time_us": len(self.trace),
                               "size": entry["size"] if size is None else size})

    def segment(self, action: str, address: int, size: int) -> None:
        self.trace.append({"action": action, "addr": address, "size": size, "stream": 0, "time_us": len(self.trace),
                           "frames": []})

    def close(self) -> list[dict[str, Any]]:
        """The trace, ended by a "snapshot" event (the action CUDA's own history records where a snapshot is taken)
        of category "unknown". PyTorch's viewer (MemoryViz.js) means to add that category itself to a trace whose
        events have categories, but misspells it (`snapshot.categores.push('unknown')` in `annotate_snapshot`) and
        throws before drawing anything; with it already there, the viewer skips that line. Readers of the trace
        (`bench.core.snapshots`, `torch.cuda._memory_viz`) count allocs and frees only."""
        self.trace.append({"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "time_us": len(self.trace),
                           "frames": [], "category": VIEWER_UNKNOWN_CATEGORY})
        return self.trace


def tracker_snapshot(tracker: memory.LiveTensorTracker, about: dict[str, Any]) -> dict[str, Any]:
    """The snapshot of the tracker's measured step (its log from the last peak reset to `close_window()`), each
    storage at a made-up address with the bytes the tracker counts it for; `about` goes under "membench"."""
    events = tracker.events
    reset, end = _window(events)
    writer = _TraceWriter(_final_categories(events, end, tracker.window_end_categories))
    pending: dict[int, tuple[memory.MemoryEvent, str]] = {}  # key -> (alloc, op) before the window
    live: dict[int, dict[str, Any]] = {}  # key -> its alloc entry in the trace
    address, op, prelude = ADDRESS_BASE, "", 0

    def place(key: int, event: memory.MemoryEvent, op: str) -> None:
        nonlocal address
        size = tracker.storage_bytes(event.nbytes)
        if size:
            live[key] = writer.alloc(key, address, size, event, op)
            address += -(-size // ALIGNMENT) * ALIGNMENT

    for index, event in enumerate(events[:end]):
        if event.kind == "op":
            op = event.op
        elif index < reset and event.kind == "alloc":
            pending[event.key] = (event, op)
        elif index < reset and event.kind == "free":
            pending.pop(event.key, None)
        elif index == reset:
            for key, (alloc, alloc_op) in sorted(pending.items()):
                place(key, alloc, alloc_op)
            prelude = len(writer.trace)
        elif event.kind == "alloc":
            place(event.key, event, op)
        elif event.kind == "free" and event.key in live:
            writer.free(live.pop(event.key))
    blocks = sorted((entry["addr"], entry["size"], entry["frames"]) for entry in live.values())
    # one made-up segment holding every address handed out, so that each block of the trace lies in it (PyTorch's
    # viewer, replaying the trace back to an earlier event, looks up the segment of every block freed since)
    segments = [_segment(ADDRESS_BASE, address - ADDRESS_BASE, blocks, False)] if address > ADDRESS_BASE else []
    return {"segments": segments, "device_traces": [writer.close()],
            "membench": {**about, "source": f"{tracker.device}_live_tensor_bytes", "allocated_at_start_bytes": 0,
                         "prelude_events": prelude}}


def _segment(address: int, size: int, blocks: list[tuple[int, int, list]], small: bool,
             free: list[tuple[int, int]] = ()) -> dict[str, Any]:
    """A segment as `torch.cuda.memory._snapshot()` lists it: its allocated blocks, and inactive blocks between."""
    out, at = [], address
    spans = sorted([(a, s, f, True) for a, s, f in blocks] + [(a, s, [], False) for a, s in free])
    for block_address, block_size, block_frames, active in spans:
        if block_address > at:
            out.append({"address": at, "size": block_address - at, "requested_size": 0, "state": "inactive",
                        "frames": []})
        out.append({"address": block_address, "size": block_size, "requested_size": block_size if active else 0,
                    "state": "active_allocated" if active else "inactive", "frames": block_frames})
        at = block_address + block_size
    if at < address + size:
        out.append({"address": at, "size": address + size - at, "requested_size": 0, "state": "inactive",
                    "frames": []})
    allocated = sum(s for _, s, _ in blocks)
    return {"device": 0, "address": address, "total_size": size, "allocated_size": allocated,
            "active_size": allocated, "requested_size": allocated, "stream": 0,
            "segment_type": "small" if small else "large", "segment_pool_id": (0, 0), "is_expandable": False,
            "frames": [], "blocks": out}


def allocator_snapshot(tracker: memory.LiveTensorTracker, about: dict[str, Any],
                       workspace_bytes: int = cuda_allocator.CUBLAS_DEFAULT_WORKSPACE_BYTES) -> dict[str, Any]:
    """The snapshot CUDA would take of the measured step as `bench.measure.cuda_allocator.replay` models it: the
    tracker's whole log runs through a `CachingAllocatorModel` (cuBLAS's workspaces included, as `replay` adds
    them); the trace is the window's, at the model's addresses and block sizes, with its segments."""
    events = tracker.events
    reset, end = _window(events)
    writer = _TraceWriter(_final_categories(events, end, tracker.window_end_categories))
    model = cuda_allocator.CachingAllocatorModel()
    held: dict[object, tuple[cuda_allocator.Block, memory.MemoryEvent, str]] = {}  # key -> (block, alloc, op)
    entries: dict[object, dict[str, Any]] = {}
    segments: list[tuple[int, int, bool]] = []
    threads: set[str] = set()
    op, prelude = "", 0

    def malloc(key: object, event: memory.MemoryEvent, op: str, in_window: bool) -> None:
        reserved = model.stats.reserved_bytes
        block = model.malloc(event.nbytes)
        if block is None:
            return
        if model.stats.reserved_bytes > reserved:
            size = model.stats.reserved_bytes - reserved
            segments.append((block.address, size, block.small))
            if in_window:
                writer.segment("segment_alloc", block.address, size)
        held[key] = (block, event, op)
        if in_window:
            entries[key] = writer.alloc(key if isinstance(key, int) else -1, block.address, block.size, event, op)

    for index, event in enumerate(events[:end]):
        in_window = index > reset
        if index == reset:
            model.reset_peak()
            for address, size, _ in segments:
                writer.segment("segment_alloc", address, size)
            for key, (block, alloc, alloc_op) in held.items():
                entries[key] = writer.alloc(key if isinstance(key, int) else -1, block.address, block.size, alloc,
                                            alloc_op)
            prelude = len(writer.trace)
        elif event.kind == "op":
            op = event.op
            thread = cuda_allocator.thread_of(event.stage)
            if op.split(".")[0] in cuda_allocator.CUBLAS_OPS and workspace_bytes and thread not in threads:
                threads.add(thread)
                workspace = memory.MemoryEvent("alloc", nbytes=workspace_bytes, stage=event.stage,
                                               module=f"cuBLAS workspace ({thread} thread)", category="workspace")
                malloc(("workspace", thread), workspace, op, in_window)
        elif event.kind == "alloc" and not cuda_allocator.outside_allocator(event):
            malloc(event.key, event, op, in_window)
        elif event.kind == "free" and event.key in held:
            block, _, _ = held.pop(event.key)
            entry = entries.pop(event.key, None)
            if entry is not None:
                writer.free(entry)
            model.free(block)
    free = [(address, size) for small in (True, False) for size, address, _ in model._free[small]]
    active = [(block.address, block.size, frames(op, alloc.module, alloc.stage))
              for block, alloc, op in held.values()]
    snapshot_segments = []
    for address, size, small in sorted(segments):
        inside = [b for b in active if address <= b[0] < address + size]
        snapshot_segments.append(_segment(address, size, inside, small,
                                          [f for f in free if address <= f[0] < address + size]))
    return {"segments": snapshot_segments, "device_traces": [writer.close()],
            "membench": {**about, "source": "cuda_caching_allocator_model", "allocated_at_start_bytes": 0,
                         "prelude_events": prelude,
                         "peak_allocated_bytes": model.stats.peak_allocated_bytes,
                         "peak_reserved_bytes": model.stats.peak_reserved_bytes}}


@contextlib.contextmanager
def cuda_history(about: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Records CUDA's own allocation history while entered (`torch.cuda.memory._record_memory_history`, Python
    stacks); the yielded dict is the snapshot once the block ends, with the bytes requested by the blocks allocated
    before recording began under "membench"["allocated_at_start_bytes"]. CUDA's trace records requested bytes, so
    its replayed peak is at most `max_memory_allocated`, which counts the allocator's blocks (512-byte multiples)."""
    holder: dict[str, Any] = {}
    torch.cuda.synchronize()
    # in the bytes the trace counts (requested, not the allocator's rounded blocks)
    start = sum(block["requested_size"] for segment in torch.cuda.memory._snapshot()["segments"]
                for block in segment["blocks"] if block["state"] == "active_allocated")
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        yield holder
        torch.cuda.synchronize()
        holder.update(torch.cuda.memory._snapshot())
        holder["membench"] = {**about, "source": "cuda_record_memory_history", "allocated_at_start_bytes": start}
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def file_name(about: dict[str, Any]) -> str:
    """The snapshot's file name from its case (workload, strategy, phase, batch, data, device) and rank; a long
    one (a workload spec with many options) shortened with a hash to 255 bytes (`bounded_name`)."""
    parts = [about.get(k) for k in ("workload", "strategy", "phase", "batch_size", "data", "device")]
    name = "-".join(str(p) for p in parts if p not in (None, ""))
    if about.get("rank") is not None:
        name += f".rank{about['rank']}"
    return bounded_name(re.sub(r"[^A-Za-z0-9.+=_-]", "_", name), SNAPSHOT_SUFFIX)


def write_snapshot(snapshot: dict[str, Any], folder: Path) -> Path:
    """Pickles the snapshot into `folder` (created) under `file_name` of its "membench" dict, atomically."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file_name(snapshot["membench"])
    with atomic_path(path) as temporary:
        with open(temporary, "wb") as handle:
            pickle.dump(plain(snapshot), handle, protocol=PICKLE_PROTOCOL)
    return path
