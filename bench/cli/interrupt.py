"""What an interrupted command (Ctrl-C, SIGTERM, SIGHUP) tells the user: set by a command once it knows what it
writes. `python -m bench` stops on each of those signals as on Ctrl-C (`bench.core.processes.stop_on_signals`)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Sequence

NOTHING_WRITTEN = "interrupted: nothing was written"

# The note printed on Ctrl-C, and the command line of this invocation (for the `--resume` command the note gives);
# "file": a file the note names, which holds something only once the command wrote it ("unwritten": the note then)
_state: dict = {"note": NOTHING_WRITTEN, "argv": [], "file": None, "unwritten": NOTHING_WRITTEN}


def start(argv: Sequence[str]) -> None:
    """A new invocation with this command line: nothing written yet."""
    _state.update(argv=list(argv), note=NOTHING_WRITTEN, file=None)


def set_note(text: str) -> None:
    _state.update(note=text, file=None)


def set_file_note(path: Path, written: str, unwritten: str) -> None:
    """The note is `written` (which names `path`) once `path` exists, `unwritten` before: a command that writes
    `path` after each finished item must not name a file that an interruption before the first left unwritten."""
    _state.update(note=written, file=Path(path), unwritten=unwritten)


def note() -> str:
    if _state["file"] is not None and not _state["file"].exists():
        return _state["unwritten"]
    return _state["note"]


def resume_command(path: Path) -> str:
    """The command line of this run with `--resume path` in place of any --resume it had."""
    kept, skip = [], False
    for arg in _state["argv"]:
        if skip:
            skip = False
            continue
        if arg == "--resume":
            skip = True
            continue
        if arg.startswith("--resume="):
            continue
        kept.append(arg)
    return shlex.join([python(), "-m", "bench", *kept, "--resume", str(path)])


def python() -> str:
    """This Python as a user would type it: relative where it lives below the current folder (.venv/bin/python)."""
    executable = Path(sys.executable)
    try:
        return str(executable.relative_to(Path.cwd()))
    except ValueError:
        return str(executable)


def resume_note(path: Path) -> str:
    """The note once `path` holds a finished case: what it holds and how to run the rest."""
    return f"interrupted: {path} holds every case that finished; to run the rest:\n  {resume_command(path)}"
