"""Library messages that tracing a prediction prints and that say nothing about its answer, silenced in this process.

A compiled step (`compile`) runs membench's own module hooks under dynamo (bench.measure.snapshot names each autograd
node after the module whose forward made it): dynamo cannot trace the autograd builtins they call, so it warns
"Dynamo does not know how to trace the builtin `..._get_sequence_nr`" (and pybind11's `__new__`), once per process,
and recompiles the hooks for each module type until its recompile limit, then warns "hit config.recompile_limit"
naming the hook: the hooks then run eagerly, as they would anyway, and the user's model is compiled as before. These
went to the user's terminal (through the fake-CUDA worker's stderr too) with every compiled prediction. The same
messages about the user's code (a recompile limit hit in their model) are left alone. Only what is printed changes:
a filter drops the message after the library decided what to do.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

# the folder of membench's `bench` package: its hooks are the functions whose recompile-limit warning is dropped
_BENCH_FOLDER = str(Path(__file__).parents[1])  # as code objects name their files: the path it was imported by
# the builtins membench's hooks call that dynamo cannot trace (bench.measure.snapshot)
_UNTRACEABLE_HOOK_BUILTINS = (r"Dynamo does not know how to trace the builtin "
                              r"`[^`]*(_get_sequence_nr|pybind11_object\.__new__)")
DYNAMO_RECOMPILES_LOGGER = "torch._dynamo.convert_frame"


class _MembenchHookRecompiles(logging.Filter):
    """Drops dynamo's recompile-limit warning where the function it gave up on is one of membench's own."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("recompile_limit" in text and f"({_BENCH_FOLDER}/" in text)


_FILTER = _MembenchHookRecompiles()


def quiet_tracing() -> None:
    """Silences, in this process, the messages of the module docstring (idempotent)."""
    warnings.filterwarnings("ignore", message=_UNTRACEABLE_HOOK_BUILTINS, category=UserWarning)
    logger = logging.getLogger(DYNAMO_RECOMPILES_LOGGER)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
