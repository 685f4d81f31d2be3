"""Layer replay of sharded ranks (bench/analysis/layer_replay_ranks.py): a predict row of an FSDP2 step on fake CUDA,
built rank by rank from traces at a few layers, has every figure of the row made by tracing every layer of every rank
(MEMBENCH_FULL_TRACE=1)."""

from __future__ import annotations

import pytest

from bench.analysis import layer_replay, layer_replay_ranks, predict
from bench.analysis.fake_engine import tracked_step
from bench.run.case import Case, bind_case
from bench.run.runner import MEMORY_WARMUP_STEPS

from .conftest import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")


def test_a_sharded_row_by_layer_replay_has_every_figure_of_the_full_trace(monkeypatch):
    # every layer checkpointed: one kind of layer; of 3 ranks, 0 and 2 traced (the last holds smaller chunks)
    case = Case("hf:llama-3.2-1b:seq_len=32:layers=7", "fsdp+checkpoint:segments=all", "train", 3, "cuda")
    replayed = predict.predict_case(case, engine="fake-cuda", ranks=3)
    monkeypatch.setenv(layer_replay.FULL_TRACE_ENV, "1")
    full = predict.predict_case(case, engine="fake-cuda", ranks=3)
    assert replayed["status"] == "ok", replayed["message"]
    assert "layer replay: traced at 3, 4 and 5 layers, the 7-layer log" in replayed["message"]
    assert "ranks 0, 2 traced" in replayed["message"] and "layer replay" not in full["message"]
    figures = [name for name in full if name != "message"]
    assert {name: replayed[name] for name in figures} == {name: full[name] for name in figures}


def test_a_ranks_log_of_checkpointed_then_plain_layers_is_its_full_trace_event_for_event():
    case = Case("hf:llama-3.2-1b:seq_len=32:layers=8", "fsdp+checkpoint", "train", 2, "cuda")
    strategy = bind_case(case, 2)[0]
    kinds = layer_replay.layer_kinds(strategy, 8)
    assert kinds is not None and kinds[1] > layer_replay.SMALLEST_PLAIN_LAYERS  # the plain layers vary too
    replayed, why = layer_replay_ranks.tracked_ranks_by_layers(case, case.strategy, "fake-cuda",
                                                               MEMORY_WARMUP_STEPS["cuda"], None, 2, strategy)
    assert why is None, why
    full = tracked_step(case, case.strategy, "fake-cuda", 1, cuda_autocast=True, ranks=2, record_events=True,
                        warmup_steps=MEMORY_WARMUP_STEPS["cuda"])
    assert (replayed.rank, replayed.ranks_traced) == (full.rank, full.ranks_traced) == (0, (0,))
    assert replayed.events == layer_replay.measured_log(full.events)
    assert replayed.peak_bytes == full.peak_bytes


def test_ranks_of_a_sharding_whose_logs_made_no_template_are_traced_in_full_without_trying():
    case = Case("hf:llama-3.2-1b:seq_len=32:layers=6", "zero2", "train", 2, "cuda")
    step, why = layer_replay_ranks.tracked_ranks_by_layers(case, case.strategy, "fake-cuda", None, None, 2,
                                                           bind_case(case, 2)[0])
    assert step is None and why.startswith("zero2 ranks: only fsdp ranks are replayed")
