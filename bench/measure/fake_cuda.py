"""Where the fake-CUDA environment is: a Python whose torch runs CUDA's code path on fake tensors, without a GPU.

`python -m bench cuda-env` builds it (bench.measure.cuda_env; in a checkout `make cuda-fake-env` runs the same, into
`.venv-cuda-fake/`): PyPI's CUDA build of the pinned torch, with stub CUDA libraries compiled from the symbols torch
imports (bench.measure.cuda_stubs). Code that wants CUDA's own operators on a machine without a GPU (CUDA's autocast
lists, cuDNN's batch norm) runs its step in that Python under `bench.measure.fake_cuda_mode.fake_cuda()`: the
allocator sees nothing there, so no memory figure is measured, only what the operators do. This module only says
where that Python is, or why there is none; it imports no torch.

Where: $MEMBENCH_CUDA_ENV where it is set; else in a checkout (this package beside its pyproject.toml)
`.venv-cuda-fake/` in the checkout, whose code that Python imports from the checkout's folder; else, for a membench
installed by pip, `membench-cuda-env/` in the environment membench is installed in, which has its own copy of
membench (`cuda-env` installs it there).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from bench.core.job_environment import CUDA_ENV_VARIABLE, PLUGINS_VARIABLE, plugin_modules, variable

ROOT = Path(__file__).resolve().parents[2]
# a checkout runs from its folder; an installed membench's folder is site-packages, which has no pyproject.toml
IN_CHECKOUT = (ROOT / "pyproject.toml").is_file()
BUILD_COMMAND = "make cuda-fake-env" if IN_CHECKOUT else "python -m bench cuda-env"
DEFAULT_VENV = ROOT / ".venv-cuda-fake" if IN_CHECKOUT else Path(sys.prefix) / "membench-cuda-env"
VENV = Path(variable(CUDA_ENV_VARIABLE) or DEFAULT_VENV).absolute()
INSTALLED_STAMP = ".installed"  # written by bench.measure.cuda_env when the environment and its stubs are complete
UNAVAILABLE_FILE = "fake-cuda-unavailable.txt"  # why it could not be built (bench.measure.cuda_env, cuda_stubs)
TIMM_UNAVAILABLE_FILE = "timm-unavailable.txt"  # why timm and torchvision are not in it (bench.measure.cuda_env)
# what makes an isolated worker (`python -m bench.run._worker`) of that Python run its case on fake CUDA tensors
WORKER_PLUGIN = "bench.measure.fake_cuda_mode"
WORKER_FLAG = "MEMBENCH_FAKE_CUDA_WORKER"


def environment_python(venv: Path | None = None) -> Path | None:
    """The fake-CUDA environment's python (`venv`, default `VENV`), or None when it is not built
    (`unavailable_reason()` says why)."""
    venv = venv or VENV
    python = venv / "bin" / "python"
    if (venv / INSTALLED_STAMP).exists() and python.exists() and not (venv / UNAVAILABLE_FILE).exists():
        return python
    return None


def unavailable_reason(venv: Path | None = None) -> str | None:
    """Why there is no fake-CUDA environment in `venv` (default `VENV`; None when there is one)."""
    venv = venv or VENV
    if environment_python(venv) is not None:
        return None
    written = venv / UNAVAILABLE_FILE
    if written.exists():
        return f"the fake-CUDA environment could not be built: {written.read_text().strip()}"
    if venv.exists():
        return f"the fake-CUDA environment in {venv} is incomplete: run `{BUILD_COMMAND}` to see why"
    return f"no fake-CUDA environment: `{BUILD_COMMAND}` builds it in {venv}"


def python_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables under which that Python imports this membench: `base` (default: this process's),
    with a checkout first on PYTHONPATH (the environment does not install a checkout; an installed membench has its
    own copy there, and this one's site-packages must stay off its path: its torch is a CPU build). PyTorch's C++
    log is held to errors there unless TORCH_CPP_LOG_LEVEL says otherwise: the fake process group's ranks make
    ProcessGroup warn, once a process, that no backend registered hooks, which says nothing of a prediction."""
    env = dict(os.environ if base is None else base)
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if IN_CHECKOUT:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def worker_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables under which `python -m bench ...` in that Python runs each isolated case on fake
    CUDA tensors (its workers import the fake-CUDA mode as a plugin): `python_environment(base)` plus those."""
    env = python_environment(base)
    plugins = plugin_modules(env)
    env[PLUGINS_VARIABLE] = ",".join(plugins if WORKER_PLUGIN in plugins else plugins + [WORKER_PLUGIN])
    env[WORKER_FLAG] = "1"
    return env
