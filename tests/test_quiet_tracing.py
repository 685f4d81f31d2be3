"""The library messages about membench's own hooks that a compiled prediction printed are dropped
(bench.measure.quiet_tracing), and the same messages about anything else are not.

tests_cuda_fake/test_quiet_tracing_fake_cuda.py runs a compiled prediction and reads its terminal output."""

from __future__ import annotations

import logging
import warnings

import pytest

from bench.measure import quiet_tracing, snapshot

HOOK_BUILTIN = ("Dynamo does not know how to trace the builtin `torch._C._autograd.pybind11_detail_function_record_v1"
                "._get_sequence_nr.` This function is either a Python builtin (e.g. _warnings.warn) or a third-party "
                "C/C++ Python extension (perhaps created with pybind).")
USER_BUILTIN = ("Dynamo does not know how to trace the builtin `mylib._native.fast_op.` This function is either a "
                "Python builtin (e.g. _warnings.warn) or a third-party C/C++ Python extension.")


def recompile_limit_record(code_file: str) -> logging.LogRecord:
    return logging.LogRecord(quiet_tracing.DYNAMO_RECOMPILES_LOGGER, logging.WARNING, "convert_frame.py", 1994,
                             "torch._dynamo hit config.%s (%s)\n   function: %s\n   last reason: %s", (
                                 "recompile_limit", 8, f"'_entered' ({code_file}:102)", "0/7: ___check_type_id"),
                             None)


@pytest.fixture
def restored_filters():
    logger = logging.getLogger(quiet_tracing.DYNAMO_RECOMPILES_LOGGER)
    before = list(logger.filters)
    # a command run in this process earlier (a CLI test) installed the filter already: start from none
    logger.filters[:] = [f for f in before if not isinstance(f, quiet_tracing._MembenchHookRecompiles)]
    with warnings.catch_warnings():
        yield logger
    logger.filters[:] = before


def test_dynamos_warnings_about_membenchs_hooks_are_dropped_and_others_kept(restored_filters):
    logger = restored_filters
    assert logger.filter(recompile_limit_record(snapshot.__file__))  # shown before
    quiet_tracing.quiet_tracing()
    quiet_tracing.quiet_tracing()  # twice: one filter
    assert sum(isinstance(f, quiet_tracing._MembenchHookRecompiles) for f in logger.filters) == 1
    assert not logger.filter(recompile_limit_record(snapshot.__file__))
    assert logger.filter(recompile_limit_record("/home/user/model.py"))  # the user's code: said
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # what a test runner sets; the quiet filter goes in front of it
        quiet_tracing.quiet_tracing()
        warnings.warn(HOOK_BUILTIN, UserWarning)
        warnings.warn(USER_BUILTIN, UserWarning)
    assert [str(w.message) for w in caught] == [USER_BUILTIN]
