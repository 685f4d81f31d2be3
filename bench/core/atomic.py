"""Atomic file writes: a file is written beside its destination and renamed over it, so that a killed process never
leaves a truncated file, only the old one or the new one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator


class WriteFailed(OSError):
    """An atomic write of `path` that failed (a full disk, a file-size limit, a quota): the temporary file is removed
    and `path` is as it was before -- the previous file whole, or no file."""

    def __init__(self, path: Path, error: OSError):
        super().__init__(error.errno, error.strerror or str(error), str(path))
        self.path = Path(path)


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yields a temporary path in `path`'s folder to write to; on success it replaces `path` (with the permissions
    of a new file), on an exception it is removed and `path` is left as it was (an OSError is raised as
    WriteFailed, which says so)."""
    path = Path(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private; ours are as readable as any other file
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException as error:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(error, OSError) and not isinstance(error, WriteFailed):
            raise WriteFailed(path, error) from error
        raise


def write_text_atomic(path: Path | str, text: str) -> None:
    """`path.write_text(text)` (UTF-8), atomically, its folder made if missing."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
