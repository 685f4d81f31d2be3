"""Layer replay of offloading strategies (bench/analysis/layer_replay.py `host_peak`): a predict row of a step that
keeps host copies (activations offloaded, FSDP2's parameters and optimizer state on the host) built from traces at a
few layers has every figure of the row made by tracing every layer, its `offload_host_peak_bytes` included."""

from __future__ import annotations

import pytest

from bench.analysis import layer_replay, predict
from bench.run.case import Case

from .conftest import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")


@pytest.mark.parametrize("workload, spec, ranks, note", [
    ("hf:llama-3.2-1b:seq_len=64:layers=7", "offload", 1, "traced at 3, 4 and 5 layers, the 7-layer log"),
    ("hf:llama-3.2-1b:seq_len=64:layers=7", "offload_activations", 1, "traced at 3, 4 and 5 layers"),
    ("hf:llama-3.2-1b:seq_len=64:layers=7", "checkpoint:segments=all+offload", 1, "traced at 3, 4 and 5 layers"),
    ("hf:llama-3.2-1b:seq_len=64:layers=7", "fsdp:offload=cpu", 2, "largest rank of 2"),
])
def test_an_offloading_row_by_layer_replay_has_every_figure_of_the_full_trace(workload, spec, ranks, note,
                                                                              monkeypatch):
    case = Case(workload, spec, "train", 2, "cuda")
    replayed = predict.predict_case(case, engine="fake-cuda", ranks=ranks)
    monkeypatch.setenv(layer_replay.FULL_TRACE_ENV, "1")
    full = predict.predict_case(case, engine="fake-cuda", ranks=ranks)
    assert replayed["status"] == "ok", replayed["message"]
    assert "layer replay: " in replayed["message"] and note in replayed["message"]
    assert "layer replay" not in full["message"] and full["offload_host_peak_bytes"] > 0
    figures = [name for name in full if name != "message"]
    assert {name: replayed[name] for name in figures} == {name: full[name] for name in figures}


def test_host_copies_that_do_not_grow_alike_per_layer_are_not_replayed():
    class Step:
        def __init__(self, host):
            self.offload_host_peak_bytes = host

    assert layer_replay.host_peak([Step(None)] * 3, 32, None) is None
    assert layer_replay.host_peak([Step(10), Step(14), Step(18)], 32, None) == 10 + 4 * 29
    for figures in ([10, 14, 19], [10, None, 18]):
        with pytest.raises(layer_replay.NoReplay):
            layer_replay.host_peak([Step(figure) for figure in figures], 32, None)
    # checkpointed and plain layers: 3+2, 4+2, 3+3 make the function, 5+4 proves it
    kinds = [Step(100 + 7 * c + 3 * p) for c, p in layer_replay.kinds_traced(25, 7)]
    assert layer_replay.host_peak(kinds, 32, (25, 7)) == 100 + 7 * 25 + 3 * 7
    kinds[-1].offload_host_peak_bytes += 1
    with pytest.raises(layer_replay.NoReplay):
        layer_replay.host_peak(kinds, 32, (25, 7))
