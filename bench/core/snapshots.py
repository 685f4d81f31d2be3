"""Reading memory snapshots in PyTorch's format (`torch.cuda.memory._snapshot()`): the peaks and the timeline by
category replayed from their device trace, without torch (the report reads them).

A snapshot is a dict `{"segments": [...], "device_traces": [[event, ...], ...]}` pickled to a file; membench adds a
`"membench"` dict that says which case it is (workload, strategy, phase, batch_size, data, device, rank) and how it
was made (`source`). Snapshots that membench writes from the exact tracker or the allocator model start their trace
with an "alloc" (and "segment_alloc") for everything live when the measured step began, so the running sum of the
trace is the live memory itself and its maximum is the row's peak. A snapshot that CUDA recorded itself
(`torch.cuda.memory._record_memory_history`) starts from what was allocated before recording began, which membench
keeps as `membench["allocated_at_start_bytes"]`.

Reading a snapshot never runs code: a results folder may come from someone else, and `pickle.load` would call
whatever a crafted file names. `read_snapshot` admits the plain types the format is made of (dict, list, tuple,
str, bytes, int, float, bool, None: pickle builds those without naming any class) and refuses a file that names
any class or function (`UnsafeSnapshotError`); it opens regular files only (a FIFO or a device is refused without
blocking: `NotASnapshotFileError`). `plain()` makes a snapshot of those types before membench writes it, so every
file membench writes reads back, and still opens at pytorch.org/memory_viz.

Example:
    snapshot = read_snapshot(Path("results/<run>.snapshots/<case>.pickle"))
    allocated, reserved = replay_peaks(snapshot)
"""

from __future__ import annotations

import os
import pickle
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.core.errors import UsageError

# The categories of a timeline, in stacking order (the breakdown columns of bench.measure.breakdown, named as a
# reader says them).
CATEGORIES = ("weights", "gradients", "optimizer_state", "activations", "temporaries", "batch", "communication")
SNAPSHOT_SUFFIX = ".pickle"
SNAPSHOT_FOLDER_SUFFIX = ".snapshots"


PLAIN_TYPES = (dict, list, tuple, str, bytes, int, float, bool, type(None))


class UnsafeSnapshotError(pickle.UnpicklingError):
    """A snapshot file that names a class or function: refused, never loaded."""


class NotASnapshotFileError(OSError):
    """A path that is not a regular file (a FIFO, a device, a folder): never read."""


class _PlainUnpickler(pickle.Unpickler):
    """Builds the plain types alone: any global a pickle names (a class, a function such as `os.system`) is
    refused, so loading can call nothing; persistent ids are refused by pickle's own default."""

    def __init__(self, handle, path: Path):
        super().__init__(handle)
        self.path = path

    def find_class(self, module: str, name: str):
        raise UnsafeSnapshotError(f"{self.path}: refused, it names {module}.{name}; a memory snapshot holds only "
                                  "plain data (dict, list, str, int, float, bool, None), so it was not loaded")


def read_snapshot(path: Path) -> dict[str, Any]:
    """The snapshot pickled at `path` (a file membench wrote, or torch.cuda.memory._dump_snapshot's), loaded with
    the plain types alone; an UnsafeSnapshotError for a file that names any class or function, a
    NotASnapshotFileError for anything but a regular file (opened without blocking, so a FIFO cannot hang)."""
    path = Path(path)
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as error:
        raise NotASnapshotFileError(f"{path}: cannot open ({error.strerror})") from None
    with os.fdopen(descriptor, "rb") as handle:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise NotASnapshotFileError(f"{path}: not a regular file (a FIFO, a device or a folder), not read")
        return _PlainUnpickler(handle, path).load()


def plain(value: Any) -> Any:
    """`value` made of the plain types `read_snapshot` admits: containers walked, a numpy or torch scalar as its
    Python number, anything else (a Path, an enum) as its text."""
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value) if type(value) in (list, tuple) else [plain(v) for v in value]
    if isinstance(value, (bool, type(None))) or type(value) in (str, bytes, int, float):
        return value
    if isinstance(value, (int, float)) or hasattr(value, "item"):
        try:
            number = value.item() if hasattr(value, "item") else value
            if type(number) in (int, float, bool):
                return number
        except (TypeError, ValueError):
            pass
    return str(value)


def snapshot_folder(results_csv: Path) -> Path:
    """The folder of the snapshots of a results CSV: `<run>.snapshots/` beside `<run>.csv`."""
    results_csv = Path(results_csv)
    return results_csv.with_name(results_csv.stem + SNAPSHOT_FOLDER_SUFFIX)


def writable_snapshot_folder(results_csv: Path) -> Path:
    """`snapshot_folder(results_csv)` for writing into: a UsageError where it is a symbolic link (writing through
    it would put files wherever it points, as a results folder from someone else chose) or is not a folder."""
    folder = snapshot_folder(results_csv)
    if folder.is_symlink():
        raise UsageError(f"{str(folder)!r} is a symbolic link; membench writes snapshots only into a real folder "
                         "beside the results file: remove the link, or run without --snapshot")
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{str(folder)!r} is not a folder; remove it, or run without --snapshot")
    return folder


def device_trace(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """The one non-empty device trace of a snapshot (membench's snapshots have one device)."""
    traces = [trace for trace in snapshot.get("device_traces", []) if trace]
    return traces[0] if traces else []


def replay_peaks(snapshot: dict[str, Any]) -> tuple[int, int | None]:
    """(allocated, reserved): the largest running sum of the trace's allocs minus completed frees, from what was
    allocated when it began, and of its segment allocs minus segment frees (None without segment events)."""
    allocated = peak = int(snapshot.get("membench", {}).get("allocated_at_start_bytes", 0))
    reserved, peak_reserved, segments = 0, 0, False
    for event in device_trace(snapshot):
        action = event["action"]
        if action == "alloc":
            allocated += event["size"]
            peak = max(peak, allocated)
        elif action == "free_completed":
            allocated -= event["size"]
        elif action == "segment_alloc":
            segments = True
            reserved += event["size"]
            peak_reserved = max(peak_reserved, reserved)
        elif action == "segment_free":
            reserved -= event["size"]
    return peak, (peak_reserved if segments else None)


@dataclass
class Timeline:
    """Live bytes by category after each event of a snapshot's trace, and where the peak is.

    `live[category][i]` is that category's bytes after event `index[i]` (of `events`), in the stage `stage[i]` (the
    last allocation's); the prelude (what was live when the step began) is one point, its last; `total[i]` their
    sum; the peak is the first largest total, at `peak_position`, with the module, stage and operator of the
    allocation that reached it.
    """

    events: int
    first_event: int  # the first event of the step itself (after the prelude of what was live when it began)
    index: list[int]
    stage: list[str]
    live: dict[str, list[int]]
    total: list[int]
    peak_bytes: int
    peak_position: int
    peak_module: str
    peak_stage: str
    peak_op: str


def category_timeline(snapshot: dict[str, Any], max_points: int | None = None) -> Timeline:
    """The trace replayed by category (an alloc's `category`, "temporaries" where it has none). With `max_points`,
    the points are thinned to about that many, always keeping the largest total of each stretch (so the peak)."""
    live = dict.fromkeys(CATEGORIES, 0)
    sizes: dict[int, tuple[str, int]] = {}
    index, stages, series, total = [], [], {c: [] for c in CATEGORIES}, []
    stage = "setup"
    start = int(snapshot.get("membench", {}).get("allocated_at_start_bytes", 0))
    first = int(snapshot.get("membench", {}).get("prelude_events", 0))
    live["temporaries"] += start  # recorded by CUDA from the middle of a run: what it held before, unattributed
    peak, position, where = -1, 0, ("", "", "")
    for number, event in enumerate(device_trace(snapshot)):
        action = event["action"]
        if action == "alloc":
            category = event.get("category", "temporaries")
            category = category if category in live else "temporaries"
            sizes[event["addr"]] = (category, event["size"])
            live[category] += event["size"]
            stage = event.get("stage", stage)
        elif action == "free_completed" and event["addr"] in sizes:
            category, size = sizes.pop(event["addr"])
            live[category] -= size
        elif action == "free_completed":
            live["temporaries"] -= event["size"]
        else:
            continue
        if number < first - 1:
            continue
        now = sum(live.values())
        index.append(number)
        stages.append(stage)
        total.append(now)
        for category in CATEGORIES:
            series[category].append(live[category])
        if now > peak:
            peak, position = now, len(total) - 1
            where = (event.get("module", ""), event.get("stage", ""), event.get("op", ""))
    trace = device_trace(snapshot)
    # a trace membench writes ends with a "snapshot" marker (bench.measure.snapshot: PyTorch's viewer needs it),
    # which is no step of the run: the step ends at its last event before it
    events = len(trace)
    while events and trace[events - 1]["action"] == "snapshot":
        events -= 1
    if not total:
        return Timeline(events, first, [], [], series, [], 0, 0, "", "", "")
    keep = list(_thinned(total, max_points, position) if max_points else range(len(total)))
    return Timeline(events, max(first - 1, 0), [index[i] for i in keep], [stages[i] for i in keep],
                    {c: [series[c][i] for i in keep] for c in CATEGORIES}, [total[i] for i in keep], peak,
                    keep.index(position), *where)


def reserved_series(snapshot: dict[str, Any], index: list[int]) -> list[int]:
    """The reserved bytes (segment allocs minus segment frees) just after each event number in `index` (sorted),
    as `category_timeline` samples the live bytes."""
    out, reserved, at = [], 0, 0
    trace = device_trace(snapshot)
    for number in index:
        for event in trace[at: number + 1]:
            if event["action"] == "segment_alloc":
                reserved += event["size"]
            elif event["action"] == "segment_free":
                reserved -= event["size"]
        at = max(at, number + 1)
        out.append(reserved)
    return out


def largest_live(snapshot: dict[str, Any], event_number: int, count: int = 10) -> list[dict[str, Any]]:
    """The `count` largest allocations live just after event `event_number` of the trace (the peak's, for
    `Timeline.index[Timeline.peak_position]`), largest first: size, category, module, operator and stage."""
    live: dict[int, dict[str, Any]] = {}
    for event in device_trace(snapshot)[: event_number + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    largest = sorted(live.values(), key=lambda e: -e["size"])[:count]
    return [{"bytes": e["size"], "category": e.get("category", "temporaries"), "module": e.get("module", ""),
             "op": e.get("op", ""), "stage": e.get("stage", "")} for e in largest]


def _thinned(total: list[int], max_points: int, peak_position: int) -> list[int]:
    """Positions to keep: the smallest and the largest of each of about `max_points / 2` stretches, and the peak's."""
    if len(total) <= max_points:
        return list(range(len(total)))
    stretch = -(-2 * len(total) // max_points)
    keep = {peak_position}
    for first in range(0, len(total), stretch):
        window = range(first, min(first + stretch, len(total)))
        keep.update((min(window, key=total.__getitem__), max(window, key=total.__getitem__)))
    return sorted(keep)
