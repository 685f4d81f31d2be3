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
def atomic_path(path: Path | str, new: bool = False) -> Iterator[Path]:
    """Yields a temporary path in `path`'s folder to write to; on success it replaces `path` (with the permissions
    of a new file), on an exception it is removed and `path` is left as it was (an OSError is raised as
    WriteFailed, which says so). With `new`, `path` is created exclusively (O_EXCL) before the rename: a file
    already there is a FileExistsError and is never replaced (a run's results are never another run's)."""
    path = Path(path)
    tmp, claimed = None, False
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private; ours are as readable as any other file
        yield Path(tmp)
        if new:  # the name is claimed here, atomically, or not at all; the rename then replaces only our claim
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 & ~umask))
            claimed = True
        os.replace(tmp, path)
    except BaseException as error:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if claimed:  # our empty claim, not a file of anyone's
            path.unlink(missing_ok=True)
        if isinstance(error, OSError) and not isinstance(error, (WriteFailed, FileExistsError)):
            raise WriteFailed(path, error) from error
        raise


def write_text_atomic(path: Path | str, text: str, new: bool = False) -> None:
    """`path.write_text(text)` (UTF-8), atomically, its folder made if missing; with `new`, never over a file
    already there (`atomic_path`)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, new) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
