"""Importing transformers for the `hf:` workloads: torchvision's Python code made importable where its compiled
operators do not load beside this torch, torchao's import warnings silenced, and a missing package one line."""

from __future__ import annotations

import contextlib
import sys

import torch

from bench.core.collector import frozen_after
from bench.core.errors import UsageError
from bench.core.quiet_import import import_torchao
from workloads.framework.torchvision_ops import torchvision_stand_ins

INSTALL_HINT = "pip install 'membench[hf]' (in a checkout: make install)"

_torchvision_stand_ins: list[torch.library.Library] = []  # kept alive: a Library's definitions die with it


def import_transformers_before_cuda() -> None:
    """transformers and torchvision imported as `import_transformers` imports them: neither asks torch about CUDA
    devices (torchao and transformers' modeling_utils do, and a child forked after that cannot use CUDA), so a fork
    server imports them before it forks workers that use CUDA (`workloads.framework.transformers_preload`).
    ImportError where one is missing."""
    _import_torchvision_without_ops()
    from transformers import CONFIG_MAPPING  # noqa: F401 - fails here, not later, when the install is broken


def _import_torchvision_without_ops() -> None:
    """Makes torchvision's Python code importable when its compiled operators do not load.

    transformers imports torchvision when it is installed. PyPI's x86_64 torchvision is a CUDA build whose
    operators do not load beside a CPU torch of the same release ("operator torchvision::nms does not exist", see
    `workloads.timm_models`); declaring the two operators its import registers fake kernels for lets it import.
    No-op where torchvision is absent or imports (also after timm's workload has done the same)."""
    try:
        import torchvision  # noqa: F401
        return
    except ImportError:
        return
    except RuntimeError as error:
        if "torchvision::" not in str(error):
            raise
    for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
        del sys.modules[name]  # the halves of the failed import
    _torchvision_stand_ins.append(torchvision_stand_ins())
    import torchvision  # noqa: F401,F811


@frozen_after()
def import_transformers():
    """The transformers module; a one-line UsageError naming the extra to install when it is missing."""
    try:
        import_transformers_before_cuda()
        with contextlib.suppress(ImportError):
            # transformers imports these where torchao is installed (the second when it builds a model), and their
            # imports warn (bench.core.quiet_import)
            import_torchao("torchao")
            import_torchao("torchao.prototype.mx_formats")
        import transformers
    except ModuleNotFoundError as error:
        if error.name in (None, "transformers"):
            raise UsageError(f"workload 'hf' needs the transformers package, not installed: {INSTALL_HINT}") from None
        raise UsageError(f"transformers is installed but its dependency {error.name!r} is not: "
                         f"{INSTALL_HINT}") from None
    return transformers
