"""The collector helpers (bench.core.collector): the cyclic collector paused inside and restored after, and the
objects an import made frozen after it, only where the block imported a module."""

from __future__ import annotations

import gc
import sys

import pytest

from bench.core.collector import collector_paused, frozen_after, imported_paused


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()


@pytest.mark.parametrize("enabled", [True, False])
def test_collector_paused_restores_the_state_it_found(enabled):
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled
        with pytest.raises(KeyError):  # restored after an error too
            with collector_paused():
                raise KeyError("x")
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_collector_paused_as_a_decorator():
    @collector_paused()
    def state():
        return gc.isenabled()

    assert gc.isenabled() and state() is False and gc.isenabled()


def test_frozen_after_freezes_only_where_a_module_was_imported(tmp_path, monkeypatch, unfrozen):
    (tmp_path / "membench_collector_probe.py").write_text("VALUE = [object() for _ in range(1000)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    gc.unfreeze()
    with frozen_after():
        pass  # imports nothing
    assert gc.get_freeze_count() == 0
    value = imported_paused("membench_collector_probe", "VALUE")
    assert len(value) == 1000 and gc.get_freeze_count() > 1000 and gc.isenabled()
    monkeypatch.delitem(sys.modules, "membench_collector_probe")


def test_frozen_after_moves_an_import_out_of_reach_before_the_collector_runs_again(tmp_path, monkeypatch, unfrozen):
    # Resumed after a paused import, the collector's first collection would walk every object the import made (0.1 s
    # after torch's); frozen first, it finds none of them
    (tmp_path / "membench_collector_cycles.py").write_text(
        "VALUE = []\nfor _ in range(20000):\n    cycle = []\n    cycle.append(cycle)\n    VALUE.append(cycle)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    gc.unfreeze()
    gc.collect()
    walked = []

    def record(phase, info):
        if phase == "start":
            walked.append(sum(len(gc.get_objects(generation)) for generation in range(info["generation"] + 1)))

    gc.callbacks.append(record)
    try:
        value = imported_paused("membench_collector_cycles", "VALUE")
        for _ in range(2000):  # allocations that would trigger the collector's next run
            [[] for _ in range(10)]
    finally:
        gc.callbacks.remove(record)
    assert len(value) == 20000 and gc.isenabled()
    assert max(walked, default=0) < 20000, walked
    monkeypatch.delitem(sys.modules, "membench_collector_cycles")
