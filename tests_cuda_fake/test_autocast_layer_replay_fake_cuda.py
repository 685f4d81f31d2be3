"""Layer replay under CUDA autocast (bench/analysis/layer_replay.py `frees_in_key_order`): the forward's exit frees
autocast's cached casts in the order of a hash table of tensors, which no layer count predicts; each run of
consecutive frees is put in storage order (an order that moves no figure), so checkpoint+amp replays, and its row has
every figure of the full trace's."""

from __future__ import annotations

import pytest

from bench.analysis import layer_replay, predict
from bench.measure.memory import MemoryEvent
from bench.run.case import Case

from .conftest import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")


@pytest.mark.parametrize("spec", ["checkpoint:segments=all+amp:dtype=float16", "amp:dtype=bfloat16"])
def test_an_autocast_row_by_layer_replay_has_every_figure_of_the_full_trace(spec, monkeypatch):
    case = Case("hf:llama-3.2-1b:seq_len=64:layers=7", spec, "train", 4, "cuda")
    replayed = predict.predict_case(case, engine="fake-cuda")
    monkeypatch.setenv(layer_replay.FULL_TRACE_ENV, "1")
    full = predict.predict_case(case, engine="fake-cuda")
    assert replayed["status"] == "ok", replayed["message"]
    assert "layer replay: traced at 3, 4 and 5 layers, the 7-layer log" in replayed["message"]
    figures = [name for name in full if name != "message"]
    assert {name: replayed[name] for name in figures} == {name: full[name] for name in figures}


def test_runs_of_frees_are_put_in_storage_order_and_nothing_else_moves():
    log = [MemoryEvent("alloc", key, 8) for key in (1, 2, 3, 4)] + [
        MemoryEvent("free", 3), MemoryEvent("free", 1), MemoryEvent("op", op="mm.default"), MemoryEvent("free", 4),
        MemoryEvent("free", 2), MemoryEvent("end")]
    ordered = layer_replay.measured_log(log)
    assert [(event.kind, event.key) for event in ordered[4:]] == [
        ("free", 1), ("free", 3), ("op", 0), ("free", 2), ("free", 4), ("end", 0)]
    assert ordered[:4] == log[:4]
