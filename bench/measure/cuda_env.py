"""Builds the fake-CUDA environment, in which `predict --device cuda` traces CUDA's own operators without a GPU:
what `python -m bench cuda-env` and `make cuda-fake-env` run.

A virtual environment with PyPI's CUDA build of exactly the pinned torch version (`===` is an exact string match:
`==` would take a local `+cpu` build), installed without its dependencies so that pip fetches none of the 2.5 GB
of nvidia libraries: torch's pure-Python dependencies and membench's are listed here instead. The CUDA libraries
torch loads are replaced by stubs compiled from the symbols torch imports (bench.measure.cuda_stubs, run with that
environment's Python). membench is importable there: a checkout from its own folder (the PYTHONPATH of
bench.measure.fake_cuda.python_environment; the tests there run the checkout's code as it is edited), a membench
installed by pip by a copy of its installed files (what pip wrote, from its RECORD), so that it needs no checkout.

The `timm:` workload's cases need torchvision and timm there too: PyPI's CUDA build of the torchvision release built
for that torch (its operator library links against the CUDA runtime, so the stubs cover it too) and timm, both
without dependencies; torchvision's (numpy, pillow) and timm's pyyaml are below; timm's huggingface_hub and
safetensors are left out: they only download and read pretrained weights, which membench never loads, and timm
imports without them. Where these cannot be installed (no network, no torchvision version known) the note
TIMM_UNAVAILABLE_FILE says why and the rest works. The `hf:` workload's peft (LoRA) and its accelerate ask for torch,
torchao (qlora's NF4 weights, the low-bit AdamW) needs none: installed without dependencies too, after torch.

Needs the network (PyPI) and a C compiler; where the environment cannot be built, UNAVAILABLE_FILE in it says why
(bench.measure.fake_cuda reports it) and `build_environment` raises Unavailable. Nothing here imports torch.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Callable

from bench.core.errors import UsageError
from bench.measure import fake_cuda

# torch's own dependencies (its wheel's, less the nvidia libraries and triton, which no fake step runs), then
# membench's (pyproject.toml's, with its `hf` extra's transformers and psutil)
TORCH_DEPENDENCIES = ["filelock", "typing-extensions>=4.10.0", "sympy>=1.13.3", "mpmath", "networkx>=2.5.1", "jinja2",
                      "markupsafe", "fsspec>=0.8.5"]
MEMBENCH_DEPENDENCIES = ["numpy", "pandas", "matplotlib", "pyyaml", "captcha", "pillow", "transformers>=5.0,<6",
                         "psutil"]
CHECKOUT_TEST_DEPENDENCIES = ["pytest", "pytest-xdist"]  # a checkout runs tests_cuda_fake/ there
# installed after torch, without dependencies (see the module's docstring)
HF_WITHOUT_DEPENDENCIES = ["peft>=0.17", "accelerate", "torchao>=0.13"]
# timm's release whose import-time dependencies the module's docstring lists (a newer one may need another)
TIMM = "timm==1.0.31"
VERSION = re.compile(r"^\d+\.\d+(\.\d+)?$")


class Unavailable(Exception):
    """The fake-CUDA environment cannot be built here; the message says why."""


def installed_version(distribution: str) -> str | None:
    """The version of `distribution` installed beside this membench, without its local part (`2.13.0` of
    `2.13.0+cpu`); None where it is not installed."""
    try:
        return importlib.metadata.version(distribution).split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None


def checked_target(path: Path) -> Path:
    """`path` as the environment's folder: absent, empty, or a virtual environment already; else a UsageError."""
    path = path.expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise UsageError(f"--path {str(path)!r} is a file; give a folder for the fake-CUDA environment")
    if path.is_dir() and any(path.iterdir()) and not (path / "pyvenv.cfg").exists():
        raise UsageError(f"--path {str(path)!r} is a folder with other files in it, not a virtual environment; give "
                         "a new or empty folder, or the environment built before")
    return path


def checked_version(value: str | None, option: str) -> str | None:
    """A release number (`2.13.0`) as given to `option`, or None; anything else is a UsageError."""
    if value is not None and not VERSION.match(value):
        raise UsageError(f"{option} {value!r}: expected a release number such as 2.13.0")
    return value


def _pip(python: Path, *arguments: str, failure: str) -> None:
    """pip installs into the environment; Unavailable(`failure`) where it fails (its own message is on stderr)."""
    done = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                           *arguments])
    if done.returncode != 0:
        raise Unavailable(failure)


def site_packages(python: Path) -> Path:
    """The environment's folder of installed packages (purelib), as its own Python says."""
    done = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True)
    return Path(done.stdout.strip())


def copy_installed_membench(target_site_packages: Path) -> int:
    """Installs this membench into another environment by copying the files pip installed here (its RECORD, its
    .dist-info included, so that the copy is an installed distribution there too); returns how many files."""
    try:
        distribution = importlib.metadata.distribution("membench")
    except importlib.metadata.PackageNotFoundError:
        raise Unavailable("membench is not installed here (pip install it, or run from a checkout)") from None
    files = [PurePosixPath(str(file)) for file in distribution.files or []]
    files = [file for file in files if file.parts[0] != ".." and "__pycache__" not in file.parts]
    running = (fake_cuda.ROOT / "bench" / "__init__.py").resolve()
    if distribution.read_text("RECORD") is None or PurePosixPath("bench/__init__.py") not in files or \
            Path(distribution.locate_file("bench/__init__.py")).resolve() != running:
        raise Unavailable(f"the membench running here ({running.parent.parent}) is not one pip installed as files "
                          "(an editable install, or a checkout): install it with `pip install .`, or build the "
                          "environment from the checkout")
    for file in files:
        destination = target_site_packages / file
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(distribution.locate_file(str(file)), destination)
    return len(files)


def build_environment(venv: Path, torch_version: str, torchvision_version: str | None = None,
                      progress: Callable[[str], None] = print) -> Path:
    """Builds (or brings up to date) the fake-CUDA environment in `venv`; returns its Python. Raises Unavailable,
    whose message is also written to `venv`/UNAVAILABLE_FILE, where it cannot be built."""
    python = venv / "bin" / "python"
    stamp = venv / fake_cuda.INSTALLED_STAMP
    try:
        if not python.exists():
            progress(f"creating the virtual environment {venv}")
            done = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
            if done.returncode != 0:
                raise Unavailable(f"{sys.executable} -m venv failed: {done.stderr.strip()[-300:]}")
        stamp.unlink(missing_ok=True)  # until it is complete again
        (venv / fake_cuda.UNAVAILABLE_FILE).unlink(missing_ok=True)
        _install_packages(python, venv, torch_version, torchvision_version, progress)
        if not fake_cuda.IN_CHECKOUT:
            progress(f"copying membench into {venv}")
            copy_installed_membench(site_packages(python))
        progress("compiling the stub CUDA libraries")
        done = subprocess.run([str(python), "-m", "bench.measure.cuda_stubs", "--torch-version", torch_version],
                              env=fake_cuda.python_environment())
        if done.returncode != 0:  # cuda_stubs wrote its reason to UNAVAILABLE_FILE and stderr
            written = venv / fake_cuda.UNAVAILABLE_FILE
            raise Unavailable(written.read_text().strip() if written.exists() else "the stubs could not be built")
    except Unavailable as error:
        if venv.is_dir():
            (venv / fake_cuda.UNAVAILABLE_FILE).write_text(f"{error}\n")
        raise
    stamp.write_text(f"torch {torch_version}\n")
    return python


def _install_packages(python: Path, venv: Path, torch_version: str, torchvision_version: str | None,
                      progress: Callable[[str], None]) -> None:
    """torch's and membench's dependencies, PyPI's CUDA torch without its own, then torchvision and timm, and the
    `hf:` workload's packages (each of the last two groups only noted where it fails)."""
    progress("installing torch's and membench's dependencies")
    tests = CHECKOUT_TEST_DEPENDENCIES if fake_cuda.IN_CHECKOUT else []
    _pip(python, *TORCH_DEPENDENCIES, *MEMBENCH_DEPENDENCIES, *tests,
         failure="pip could not install torch's and the project's dependencies (no network?)")
    progress(f"installing PyPI's CUDA build of torch {torch_version}, without its nvidia libraries")
    _pip(python, "--no-deps", f"torch==={torch_version}",
         failure=f"pip could not install torch==={torch_version}, PyPI's CUDA build (no network?)")
    timm_note = venv / fake_cuda.TIMM_UNAVAILABLE_FILE
    timm_note.unlink(missing_ok=True)
    try:
        if torchvision_version is None:
            raise Unavailable("no torchvision version given (--torchvision-version; none is installed beside "
                              "membench to take it from)")
        progress(f"installing torchvision {torchvision_version} and {TIMM} (the `timm:` workload)")
        _pip(python, "--no-deps", f"torchvision==={torchvision_version}", TIMM,
             failure=f"pip could not install torchvision==={torchvision_version} and {TIMM} (no network?)")
    except Unavailable as missing:
        timm_note.write_text(f"{missing}\n")
        progress(f"note: {missing}: the `timm:` workload cannot run on fake CUDA")
    try:
        _pip(python, "--no-deps", *HF_WITHOUT_DEPENDENCIES,
             failure=f"pip could not install {' '.join(HF_WITHOUT_DEPENDENCIES)}")
    except Unavailable as missing:
        progress(f"note: {missing}: lora, qlora and the low-bit optimizers cannot run on fake CUDA")
