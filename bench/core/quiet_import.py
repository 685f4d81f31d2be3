"""Imports of optional packages whose import logs warnings that do not concern membench's runs (torchao's)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
from types import ModuleType


@contextlib.contextmanager
def quiet_loggers(*names: str):
    """Inside, the named loggers drop warnings (errors still show)."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def import_torchao(module: str = "torchao") -> ModuleType:
    """`module` of torchao, imported without its warnings: torchao's first import warns of each compiled CUDA kernel
    a CPU build of torch cannot load, and torch of torchao's enum registrations; membench uses neither. transformers
    imports torchao whenever it is installed, so every `hf:` run printed them. ImportError where it is missing.
    An imported module is returned as it is: quieting the loggers clears every logger's cache (qlora asks for its
    module in each NF4 layer's forward, 3,228 times in a prediction of llama-3.1-8b, 0.3 s)."""
    imported = sys.modules.get(module)
    if imported is not None:
        return imported
    with quiet_loggers("torchao", "torch.utils._pytree"):
        return importlib.import_module(module)
