"""Where the verification keeps its full tensors (gradients, stepped weights, outputs, buffers): in an unlinked
temporary file, read back one tensor at a time, so that the baseline's snapshot kept for every strategy, and each
strategy's own, cost the process no resident memory (they held 2-4x the model's size).

Every value is kept whole and compared whole: a file is a place, not a summary. Fake tensors (the fake-CUDA run)
hold no memory and have no bytes to write: they stay in memory (`MemoryStore`).
"""

from __future__ import annotations

import tempfile
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch


class MemoryStore:
    """Tensors kept as they are, in this process (fake tensors, or a caller that wants no file)."""

    def __init__(self):
        self._tensors: dict[Any, torch.Tensor] = {}

    def put(self, key: Any, tensor: torch.Tensor) -> None:
        self._tensors[key] = tensor.detach().clone()

    def get(self, key: Any) -> torch.Tensor:
        return self._tensors[key]

    def shape(self, key: Any) -> torch.Size:
        return self._tensors[key].shape

    def __contains__(self, key: Any) -> bool:
        return key in self._tensors


class FileStore:
    """Tensors written one after another into an unlinked temporary file (in TMPDIR: it vanishes with the process,
    even a killed one), each read back into a fresh tensor on `get`; the process holds none of them between."""

    def __init__(self, folder: str | None = None):
        self._file = tempfile.TemporaryFile(prefix="membench-verify-", dir=folder)
        self._index: dict[Any, tuple[int, torch.dtype, torch.Size]] = {}
        self._end = 0

    def put(self, key: Any, tensor: torch.Tensor) -> None:
        """Writes `tensor` (a CPU tensor, not kept) under `key`; a later put of the same key replaces it."""
        flat = tensor.detach().contiguous().reshape(-1)
        self._file.seek(self._end)
        if flat.numel():
            self._file.write(memoryview(flat.view(torch.uint8).numpy()))
        self._index[key] = (self._end, tensor.dtype, tensor.shape)
        self._end += flat.numel() * flat.element_size()

    def get(self, key: Any) -> torch.Tensor:
        offset, dtype, shape = self._index[key]
        tensor = torch.empty(shape, dtype=dtype)
        flat = tensor.reshape(-1)
        if flat.numel():
            self._file.seek(offset)
            view = memoryview(flat.view(torch.uint8).numpy())
            while len(view):  # a buffered file may return less than asked
                read = self._file.readinto(view)
                if not read:
                    raise EOFError(f"verification file ended inside {key!r}")
                view = view[read:]
        return tensor

    def shape(self, key: Any) -> torch.Size:
        return self._index[key][2]

    def chunks(self, key: Any, elements: int) -> Iterator[torch.Tensor]:
        """The tensor under `key`, flattened, in pieces of at most `elements`: a tensor larger than memory allows
        twice (an embedding's gradient) is compared without holding it whole."""
        offset, dtype, shape = self._index[key]
        total = shape.numel()
        size = torch.empty((), dtype=dtype).element_size()
        for start in range(0, total, elements):
            piece = torch.empty(min(elements, total - start), dtype=dtype)
            self._file.seek(offset + start * size)
            view = memoryview(piece.view(torch.uint8).numpy())
            while len(view):
                read = self._file.readinto(view)
                if not read:
                    raise EOFError(f"verification file ended inside {key!r}")
                view = view[read:]
            yield piece

    def __contains__(self, key: Any) -> bool:
        return key in self._index

    @property
    def size_bytes(self) -> int:
        return self._end

    def close(self) -> None:
        self._file.close()


Store = MemoryStore | FileStore


class StoredTensors(Mapping[str, Any]):
    """Name -> tensor (or None: no gradient) of one group of a store, read from it on each access."""

    def __init__(self, store: Store, group: str, names: Sequence[str], missing: Sequence[str] = ()):
        self.store, self.group = store, group
        self._names = list(dict.fromkeys([*names, *missing]))
        self._missing = set(missing)

    def __getitem__(self, name: str) -> torch.Tensor | None:
        if name in self._missing:
            return None
        if (self.group, name) not in self.store:
            raise KeyError(name)
        return self.store.get((self.group, name))

    def present(self) -> list[str]:
        """The names that have a tensor (not None)."""
        return [name for name in self._names if name not in self._missing]

    def __contains__(self, name: object) -> bool:  # without reading the tensor, as Mapping's would
        return name in self._missing or (self.group, name) in self.store

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class StoredList(Sequence[Any]):
    """A list of tensors of a store (the model's outputs), each read from it on access; `shapes` without reading."""

    def __init__(self, store: Store, group: str, count: int):
        self.store, self.group, self.count = store, group, count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.count))]
        if not -self.count <= index < self.count:
            raise IndexError(index)
        return self.store.get((self.group, index % self.count))

    def __len__(self) -> int:
        return self.count

    def shapes(self) -> list[torch.Size]:
        return [self.store.shape((self.group, i)) for i in range(self.count)]


def store_for(tensors: Callable[[], Iterator[torch.Tensor]]) -> Store:
    """A file store, or a memory store where the session's tensors are fake (no bytes) or not on the CPU's memory
    (meta)."""
    from torch._subclasses.fake_tensor import is_fake

    first = next(iter(tensors()), None)
    if first is not None and (is_fake(first) or first.device.type == "meta"):
        return MemoryStore()
    return FileStore()


CHUNK_ELEMENTS = 1 << 20  # 4 MiB of float32 per piece


def difference_norms(result: Mapping[str, Any], reference: Mapping[str, Any], name: str) -> tuple[float, float, float]:
    """(max |got - ref|, ||got - ref||, ||ref||) of one tensor of two snapshots, read piece by piece where both are
    in file stores with the same shape (at most two pieces held at once), else from the whole tensors."""
    if isinstance(result, StoredTensors) and isinstance(reference, StoredTensors) \
            and isinstance(result.store, FileStore) and isinstance(reference.store, FileStore) \
            and result.store.shape((result.group, name)) == reference.store.shape((reference.group, name)):
        worst, diff_sq, ref_sq = 0.0, 0.0, 0.0
        pieces = zip(result.store.chunks((result.group, name), CHUNK_ELEMENTS),
                     reference.store.chunks((reference.group, name), CHUNK_ELEMENTS))
        for got, ref in pieces:  # float32 pieces; their squared norms summed in Python's float (double)
            diff = got - ref
            worst = _nan_max(worst, float(diff.abs().max())) if diff.numel() else worst
            diff_sq += float(torch.linalg.vector_norm(diff)) ** 2
            ref_sq += float(torch.linalg.vector_norm(ref)) ** 2
        return worst, diff_sq ** 0.5, ref_sq ** 0.5
    got, ref = result[name], reference[name]
    diff = got - ref
    return (float(diff.abs().max()) if diff.numel() else 0.0), float(diff.norm()), float(ref.norm())


def tensor_norm(tensors: Mapping[str, Any], name: str) -> float:
    """||tensor||, read piece by piece from a file store."""
    if isinstance(tensors, StoredTensors) and isinstance(tensors.store, FileStore):
        return sum(float(torch.linalg.vector_norm(piece)) ** 2 for piece in
                   tensors.store.chunks((tensors.group, name), CHUNK_ELEMENTS)) ** 0.5
    return float(tensors[name].norm())


def _nan_max(a: float, b: float) -> float:
    return a + b if a != a or b != b else max(a, b)
