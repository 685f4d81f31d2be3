"""Atomic file writes: a file is written beside its destination and renamed over it, so that a killed process never
leaves a truncated file, only the old one or the new one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yields a temporary path in `path`'s folder to write to; on success it replaces `path` (with the permissions
    of a new file), on an exception it is removed and `path` is left as it was."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private; ours are as readable as any other file
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path | str, text: str) -> None:
    """`path.write_text(text)` (UTF-8), atomically."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
