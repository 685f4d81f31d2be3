"""The live-tensor tracker's table of live storages: each storage's bytes, category and event-log number, by the
storage object's identity (bench.measure.memory.LiveTensorTracker)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StorageInfo:
    """A live storage's bytes (rounded to the tracker's block), category and number in the event log."""

    nbytes: int
    category: str
    key: int = 0  # the storage's number in `events` (0 while resized to no bytes)


class StorageTable:
    """A tracker's live storages (storage -> `StorageInfo`), by the storage object's identity: what torch's
    WeakIdKeyDictionary gave (`get`, `in`, `values`, in the order registered) without making a weak reference per
    look-up, once or more per tensor of every operator. An entry leaves when its storage is released (the tracker's
    own weak reference to it: `LiveTensorTracker._released`), before its id can be another object's."""

    __slots__ = ("by_id",)

    def __init__(self):
        self.by_id: dict[int, StorageInfo] = {}

    def get(self, storage, default=None):
        return self.by_id.get(id(storage), default)

    def __contains__(self, storage) -> bool:
        return id(storage) in self.by_id

    def __setitem__(self, storage, info: StorageInfo) -> None:
        self.by_id[id(storage)] = info

    def __len__(self) -> int:
        return len(self.by_id)

    def values(self):
        return self.by_id.values()
