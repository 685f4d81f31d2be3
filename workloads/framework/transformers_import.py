"""Importing transformers for the `hf:` workloads: torchvision's Python code made importable where its compiled
operators do not load beside this torch, torchao's import warnings silenced, and a missing package one line."""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import os
import pickle
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
    with _import_structure_read_once():
        from transformers import CONFIG_MAPPING  # noqa: F401 - fails here, not later, when the install is broken


_IMPORT_UTILS = "transformers.utils.import_utils"


@contextlib.contextmanager
def _import_structure_read_once():
    """Inside, where transformers is imported now, its models folder's import structure is read once, not twice.

    transformers' `__init__` and its `models/__init__` each call `define_import_structure` on the models folder,
    which reads the `__all__` of each of its ~1,700 files (0.25 s each time, in every process that reads an `hf:`
    workload); the second call now gets a copy of the first's (`create_import_structure_from_path` depends on the
    files alone). Its module is wrapped as it is first imported (a finder ahead of the others); nothing changes where
    transformers was already imported or that function is missing."""
    if _IMPORT_UTILS in sys.modules:
        yield
        return
    finder = _ImportStructureOnce()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)


class _ImportStructureOnce(importlib.abc.MetaPathFinder):
    """Finds transformers' import_utils as the path finder does, and wraps its `create_import_structure_from_path`
    with a copy per folder (`_read_once`) once the module has run; then steps aside."""

    def find_spec(self, name, path, target=None):
        if name != _IMPORT_UTILS:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            if callable(getattr(module, "create_import_structure_from_path", None)):
                module.create_import_structure_from_path = _read_once(module.create_import_structure_from_path)
        spec.loader.exec_module = exec_module
        return spec


def _read_once(create):
    """`create(module_path)` computed once per folder (a file's is its folder's), each call given its own copy."""
    read: dict[str, bytes] = {}

    @functools.wraps(create)
    def create_once(module_path):
        folder = os.path.realpath(module_path)
        folder = folder if os.path.isdir(folder) else os.path.dirname(folder)
        if folder not in read:
            read[folder] = pickle.dumps(create(module_path), protocol=pickle.HIGHEST_PROTOCOL)
        return pickle.loads(read[folder])
    return create_once


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
