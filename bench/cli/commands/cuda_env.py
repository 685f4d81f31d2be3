"""`cuda-env`: builds the fake-CUDA environment in which `predict`, `fit` and `plan` trace CUDA's own operators on a
machine without a GPU (bench.measure.cuda_env), for a checkout or a membench installed by pip alike.

Imports no torch: it runs before any exists there (`make cuda-fake-env` runs it with the machine's Python)."""

from __future__ import annotations

import sys
from pathlib import Path

from bench.cli.command import Command
from bench.core.errors import UsageError
from bench.core.job_environment import CUDA_ENV_VARIABLE
from bench.measure import cuda_env, fake_cuda


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def add_arguments(parser) -> None:
    parser.add_argument("--path", default=None,
                        help=f"the environment's folder (default: where `predict` looks for it, ${CUDA_ENV_VARIABLE} "
                             "or, in a checkout, .venv-cuda-fake, else membench-cuda-env in the environment membench "
                             "is installed in); run it again after upgrading membench")
    parser.add_argument("--torch-version", default=None,
                        help="the torch release whose CUDA build is installed (default: the torch installed here)")
    parser.add_argument("--torchvision-version", default=None,
                        help="the torchvision release built for it, for the `timm:` workload (default: the "
                             "torchvision installed here; without one the `timm:` workload is left out)")


def run(args) -> int:
    """Builds the environment in --path (default: where `predict` looks, bench.measure.fake_cuda.VENV); exit 1
    with the reason where it cannot be built (no network, no C compiler, a torch without a CUDA 13 build)."""
    venv = cuda_env.checked_target(Path(args.path) if args.path else fake_cuda.VENV)
    torch_version = (cuda_env.checked_version(args.torch_version, "--torch-version")
                     or cuda_env.installed_version("torch"))
    if torch_version is None:
        raise UsageError("--torch-version: no torch is installed beside membench to take the version from; give the "
                         "torch release, e.g. --torch-version 2.13.0")
    torchvision_version = (cuda_env.checked_version(args.torchvision_version, "--torchvision-version")
                           or cuda_env.installed_version("torchvision"))
    try:
        cuda_env.build_environment(venv, torch_version, torchvision_version, progress=_progress)
    except cuda_env.Unavailable as error:
        print(f"error: the fake-CUDA environment could not be built in {venv}: {error}", file=sys.stderr)
        return 1
    print(f"the fake-CUDA environment is ready in {venv} (PyPI's CUDA build of torch {torch_version} over stub CUDA "
          "libraries)")
    if venv != fake_cuda.VENV:
        print(f"`predict` uses it where {CUDA_ENV_VARIABLE}={venv} is set (it looks in {fake_cuda.VENV} otherwise)")
    return 0


COMMAND = Command("cuda-env", "build the fake-CUDA environment in which CUDA predictions trace CUDA's own operators "
                              "without a GPU (PyPI's CUDA build of torch over stub CUDA libraries; needs the network "
                              "and a C compiler)", add_arguments, run)
