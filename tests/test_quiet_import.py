"""bench.core.quiet_import: torchao's modules imported with the named loggers quiet, and a module already imported
returned without touching any logger (quieting clears every logger's cache: qlora asks for its module per layer)."""

from __future__ import annotations

import logging

import pytest

from bench.core.quiet_import import import_torchao, quiet_loggers


def test_quiet_loggers_drop_warnings_inside_and_restore_the_levels():
    logger = logging.getLogger("membench.test.quiet")
    logger.setLevel(logging.INFO)
    with quiet_loggers("membench.test.quiet"):
        assert not logger.isEnabledFor(logging.WARNING) and logger.isEnabledFor(logging.ERROR)
    assert logger.level == logging.INFO


def test_an_imported_module_is_returned_without_touching_a_logger(monkeypatch):
    levels_set = []
    monkeypatch.setattr(logging.Logger, "setLevel", lambda self, level: levels_set.append(level))
    assert import_torchao("json").dumps([1]) == "[1]"  # imported by then: any module stands for torchao's here
    assert levels_set == []


def test_a_missing_module_is_an_import_error():
    with pytest.raises(ImportError):
        import_torchao("membench_no_such_module")
