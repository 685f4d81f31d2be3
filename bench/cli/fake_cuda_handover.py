"""Handing a whole `predict`/`fit`/`plan` command for CUDA to the fake-CUDA environment's Python before it imports
torch, when its CUDA work would go there anyway: one interpreter and one import of torch instead of two.

Without a GPU, on a torch built without CUDA (.venv's), `predict --device cuda` used to import torch, the models and
pandas here (seconds), then start the fake-CUDA environment's Python (bench.measure.fake_cuda) for its cases, which
imported all of them again (bench.analysis.fake_cuda_worker). There, torch sees the stubs' CUDA device, so the same
command predicts its CUDA cases in its own process, with the same code (`predict.predict_cases` and the searches
call what the workers call), so the same rows. `python -m bench` decides from its parsed arguments alone, before any
heavy import (`handover_python`), and `os.execve`s itself into that Python (`hand_over`): the same process (its id,
its signals, its exit status, its standard streams and working directory, so `--out` and relative paths mean what
they meant), with the checkout on PYTHONPATH as the workers had it.

Handed over only where nothing the command does needs what only this Python has: a torch built without CUDA or
ROCm here (read from its version.py, not imported; a CUDA build decides for itself, as before), the fake-CUDA
environment built (else the command runs here, predicting on the CPU's operators as before), no `--config` (a
trainer's configuration may need TRL's or torchtune's files, which that environment lacks), the local executor
(Ray is not installed there), no `--memory-limit` and no `--confirm` (they act on a device). Everything else runs
here, the old way, with its worker processes. The handed-over process imports the modules $MEMBENCH_PLUGINS names
before the command runs, as the worker did before predicting. HANDED_OVER_VARIABLE, set in the handed-over process,
keeps it (and anything it starts) from handing over again; set by hand it keeps a command in this Python.

What changes for the user: the progress lines no longer say "on fake CUDA", and a crash of that Python below Python
(a signal, an abort in the stubs) ends the command, where the worker path predicted its cases here instead; a
Python exception in a case falls back to the fake and cpu engines case by case in both.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Sequence

from bench.measure import fake_cuda

# set in the handed-over process to the Python it came from: that process (and any `python -m bench` it starts)
# never hands over again; set by hand (any value), a command stays in the Python it was started in
HANDED_OVER_VARIABLE = "MEMBENCH_FAKE_CUDA_HANDED_OVER"
COMMANDS = ("predict", "fit", "plan")
# `cuda: Optional[str] = '13.0'` / `hip = None` in torch/version.py (written by torch's build)
_VERSION_LINE = re.compile(r"^(cuda|hip)\s*(?::[^=]*)?=\s*(.+?)\s*$", re.MULTILINE)


def torch_build() -> str | None:
    """"cpu" where this Python's torch is a build without CUDA or ROCm, "gpu" where it has one of them, None where
    that cannot be read (no torch, an unusual version.py): read from torch/version.py without importing torch."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    except OSError:
        return None
    found = dict(match.groups() for match in _VERSION_LINE.finditer(text))
    if "cuda" not in found:
        return None
    return "cpu" if all(found.get(name, "None") == "None" for name in ("cuda", "hip")) else "gpu"


def _cuda_device(args: argparse.Namespace) -> bool:
    """Whether the command predicts CUDA: predict's --device defaults to cuda, fit's and plan's to cuda with --gpu."""
    device = getattr(args, "device", None)
    if device is None:
        device = "cuda" if args.command == "predict" or getattr(args, "gpu", None) else "cpu"
    return device == "cuda"


def _needs_this_python(args: argparse.Namespace) -> bool:
    """Whether the command uses something the fake-CUDA environment lacks, or acts on a device (module docstring)."""
    return bool(getattr(args, "config", None) or getattr(args, "memory_limit", None)
                or getattr(args, "confirm", False) or getattr(args, "confirm_front", False)
                or getattr(args, "list_gpus", False) or getattr(args, "executor", None) not in (None, "local")
                or getattr(args, "engine", "auto") not in ("auto", "fake-cuda"))


def handover_python(args: argparse.Namespace) -> Path | None:
    """The fake-CUDA environment's Python to run this whole command in, or None to run it here."""
    if (args.command not in COMMANDS or HANDED_OVER_VARIABLE in os.environ or not _cuda_device(args)
            or _needs_this_python(args)):
        return None
    python = fake_cuda.environment_python()
    if python is None or _is_fake_cuda_python(python):
        return None
    return python if torch_build() == "cpu" else None


def _is_fake_cuda_python(python: Path | None) -> bool:
    return python is not None and Path(sys.prefix).resolve() == python.parent.parent.resolve()


def import_plugins_on_arrival() -> None:
    """In a handed-over process, the modules $MEMBENCH_PLUGINS names imported before the command runs, as the worker
    it replaces imported them before predicting (bench.analysis.fake_cuda_worker.serve)."""
    if HANDED_OVER_VARIABLE in os.environ and _is_fake_cuda_python(fake_cuda.environment_python()):
        from bench.run._worker import import_plugins

        import_plugins()


def hand_over(python: Path, argv: Sequence[str]) -> None:
    """Replaces this process by `python -m bench ARGV` (returns only where the exec fails, to run the command
    here)."""
    env = fake_cuda.python_environment()
    env[HANDED_OVER_VARIABLE] = sys.executable
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(str(python), [str(python), "-m", "bench", *argv], env)
    except OSError:  # not executable after all: the worker path, as without the environment
        return
