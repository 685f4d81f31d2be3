"""Layer replay (bench/analysis/layer_replay.py) gives what the full trace gives, to the byte: the event log it builds
for N layers from traces at 3 and 4 equals the log of a real N-layer trace event for event, and a predict row made by
it has every figure of the row made by tracing every layer (MEMBENCH_FULL_TRACE=1); where a strategy treats layers
differently it is not used, and the row says nothing of it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.analysis import layer_replay, predict
from bench.measure import layer_template
from bench.measure.memory import MemoryEvent
from bench.analysis.fake_engine import PredictionMeter, bound_device, tracked_step
from bench.measure import cuda_allocator
from bench.run.case import Case
from bench.run.case import bind_case
from bench.run.runner import MEMORY_WARMUP_STEPS

# a Llama decoder cut to 6 layers (fake tensors: the width costs no time), short sequences
SMALL = "hf:llama-3.2-1b:seq_len=32:layers=6"
FULL_SIZE = "hf:llama-3.1-8b:seq_len=4096"


def _full_trace(case: Case, engine: str = "fake"):
    planned = bind_case(replace(case, device=bound_device(engine)), 1)[0]
    planned.plan(PredictionMeter(case))
    return tracked_step(case, case.strategy, engine, 1, cuda_autocast=True, record_events=True,
                        warmup_steps=MEMORY_WARMUP_STEPS["cuda"], planned=planned)


def test_the_log_built_for_six_layers_is_the_six_layer_trace_event_for_event():
    # bf16_weights replaces the parameters on fake tensors: each must still have its gradient filed as one
    case = Case(SMALL, "bf16_weights+lora+checkpoint:segments=all", "train", 2, "cuda")
    replayed, why = layer_replay.tracked_step_by_layers(case, case.strategy, "fake", MEMORY_WARMUP_STEPS["cuda"],
                                                        None)
    assert why is None, why
    full = _full_trace(case)
    assert replayed.events == layer_replay.measured_log(full.events)
    assert replayed.recompute_plan == full.recompute_plan == "0 1 2 3 4 5"
    by_replay, by_full_trace = cuda_allocator.replay(replayed.events), cuda_allocator.replay(full.events)
    assert by_replay == cuda_allocator.replay(layer_replay.measured_log(full.events))
    for figure in ("max_allocated_bytes", "max_reserved_bytes", "cublas_workspaces", "peak_by_category"):
        assert getattr(by_replay, figure) == getattr(by_full_trace, figure)


def test_a_replayed_row_has_every_figure_of_the_full_trace(monkeypatch):
    case = Case(SMALL, "baseline", "train", 2, "cuda")
    replayed = predict.predict_case(case, engine="fake")
    monkeypatch.setenv(layer_replay.FULL_TRACE_ENV, "1")
    full = predict.predict_case(case, engine="fake")
    assert "layer replay: traced at 3, 4 and 5 layers, the 6-layer log" in replayed["message"]
    assert "layer replay" not in full["message"]
    figures = [name for name in full if name != "message"]
    assert {name: replayed[name] for name in figures} == {name: full[name] for name in figures}
    assert replayed["predicted_bytes"] > 0


def test_a_checkpoint_plan_that_leaves_layers_unchecked_is_traced_in_full():
    case = Case(SMALL, "lora+checkpoint", "train", 2, "cuda")  # segments=auto: the last layer runs plainly
    strategy = bind_case(case, 1)[0]
    assert "checkpoint plan" in layer_replay.why_not_replayable(case, strategy, 1, "fake", snapshot=False)
    for other in (Case(SMALL, "lora", "train", 2, "cpu"), Case("hf:tiny-llama", "lora", "train", 2, "cuda")):
        assert layer_replay.why_not_replayable(other, bind_case(other, 1)[0], 1, "fake", snapshot=False)
    assert layer_replay.why_not_replayable(case, strategy, 1, "fake", snapshot=True)


def test_the_full_trace_is_forced_by_the_environment(monkeypatch):
    case = Case(SMALL, "lora", "train", 2, "cuda")
    strategy = bind_case(case, 1)[0]
    assert layer_replay.why_not_replayable(case, strategy, 1, "fake", snapshot=False) is None
    monkeypatch.setenv(layer_replay.FULL_TRACE_ENV, "1")
    assert layer_replay.FULL_TRACE_ENV in layer_replay.why_not_replayable(case, strategy, 1, "fake", snapshot=False)


def test_a_log_that_does_not_grow_by_whole_layers_makes_no_template():
    def log(layers: int, extra: int = 0) -> list:
        events = [MemoryEvent("alloc", 1, 100, "setup")]
        for layer in range(layers):
            events += [MemoryEvent("op", stage="forward", op="mm.default"),
                       MemoryEvent("alloc", layer + 2, 64, "forward", module=f"model.layers.{layer}")]
        events += [MemoryEvent("alloc", layers + 2 + i, 8 * (i + 1), "forward") for i in range(extra)]
        return events + [MemoryEvent("end")]

    template = layer_template.LayerTemplate(log(3), log(4), 3)
    assert template.events(9) == log(9)
    with pytest.raises(layer_template.NoReplay):
        layer_template.LayerTemplate(log(3), log(4, extra=3), 3)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["lora+checkpoint:segments=all", "bf16_weights+qlora+checkpoint:segments=all"])
def test_full_size_llama_rows_by_layer_replay_equal_the_full_trace(spec, monkeypatch):
    case = Case(FULL_SIZE, spec, "train", 1, "cuda")
    (replayed,) = predict.predict_cases([case])
    monkeypatch.setenv(layer_replay.FULL_TRACE_ENV, "1")
    (full,) = predict.predict_cases([case])
    assert "layer replay: traced at 3, 4 and 5 layers, the 32-layer log" in replayed["message"]
    figures = [name for name in full if name != "message"]
    assert {name: replayed[name] for name in figures} == {name: full[name] for name in figures}
