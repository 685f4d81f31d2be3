"""Step repeat (bench/measure/step_repeat.py): a fake-cuda step whose measured step is built from its last warm-up step
(`repeat_warmup`, layer replay's smaller traces) logs what the step run for real logs, event for event, with the same
peak and bytes by category at it; and the breakdown prepared before the last warm-up step as well moves no figure of
a prediction. Run with CUDA's two warm-up steps (this suite's other tests run one, which leaves nothing to repeat)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import pytest
import torch

from bench.analysis import layer_replay, predict
from bench.analysis.fake_engine import PredictionMeter, bound_device, tracked_step
from bench.measure import cuda_allocator
from bench.measure.memory import MemoryEvent
from bench.measure.step_repeat import NotSteady, repeated_step
from bench.run import runner
from bench.run.case import Case, bind_case
from bench.run.ranks import fake_process_group

from .conftest import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

SMALL = "hf:llama-3.2-1b:seq_len=64:layers=3"


@pytest.fixture
def two_warmup_steps(monkeypatch):
    monkeypatch.setitem(runner.MEMORY_WARMUP_STEPS, "cuda", 2)


def _step(case: Case, repeat: bool, ranks: int = 1, rank: int | None = None):
    group = fake_process_group(ranks, rank, device="cuda") if rank is not None else contextlib.nullcontext()
    with group:
        planned = bind_case(replace(case, device=bound_device("fake-cuda")), ranks)[0]
        planned.plan(PredictionMeter(case))
        return tracked_step(case, case.strategy, "fake-cuda", 1, ranks=ranks, record_events=True, planned=planned,
                            repeat_warmup=repeat)


@pytest.mark.parametrize("spec, ranks", [
    ("lora+checkpoint:segments=all", 1),
    ("bf16_weights+qlora:scaler_block=8+checkpoint", 1),
    ("amp+checkpoint", 1),                     # GradScaler's state between steps
    ("optimizer_in_backward", 1),              # each gradient freed inside the backward
    ("grad_accumulation:micro_batches=2", 1),
    ("checkpoint+offload_activations", 1),
    ("compile:scope=layers", 1),
    ("fsdp+checkpoint", 2),
])
def test_a_repeated_step_logs_what_the_step_run_logs(spec, ranks, two_warmup_steps):
    case = Case(SMALL, spec, "train", 2, "cuda")
    rank = 0 if ranks > 1 else None
    real, repeated = _step(case, False, ranks, rank), _step(case, True, ranks, rank)
    assert layer_replay.measured_log(repeated.events) == layer_replay.measured_log(real.events)
    assert repeated.peak_bytes == real.peak_bytes
    assert repeated.offload_host_peak_bytes == real.offload_host_peak_bytes
    assert _nonzero(repeated.peak_by_category) == _nonzero(real.peak_by_category)
    by_real = cuda_allocator.replay(layer_replay.measured_log(real.events))
    assert cuda_allocator.replay(layer_replay.measured_log(repeated.events)) == by_real


def _nonzero(by_category: dict) -> dict:
    return {category: nbytes for category, nbytes in by_category.items() if nbytes}


def test_the_breakdown_prepared_before_the_last_warmup_step_moves_no_figure(two_warmup_steps, monkeypatch):
    """The full trace with events (its warm-up step prepared as the measured one) gives the row the tracker's own
    figures gave before: a prediction without layer replay, with and without the event log."""
    case = Case("hf:llama-3.2-1b:seq_len=64:layers=7", "lora+checkpoint:segments=all", "train", 2, "cuda")
    replayed = predict.predict_case(case, engine="fake-cuda")
    monkeypatch.setenv(layer_replay.FULL_TRACE_ENV, "1")
    full = predict.predict_case(case, engine="fake-cuda")
    assert "layer replay: traced at 3, 4 and 5 layers" in replayed["message"], replayed["message"]
    figures = [name for name in full if name != "message"]
    assert {name: replayed[name] for name in figures} == {name: full[name] for name in figures}
    plain = tracked_step(case, case.strategy, "fake-cuda", 1)
    logged = tracked_step(case, case.strategy, "fake-cuda", 1, record_events=True)
    assert (plain.peak_bytes, _nonzero(plain.peak_by_category)) == (logged.peak_bytes,
                                                                    _nonzero(logged.peak_by_category))


def _log(*events) -> list[MemoryEvent]:
    return [MemoryEvent(kind, key, nbytes) for kind, key, nbytes in events]


def test_what_a_step_frees_of_the_one_before_it_is_what_it_leaves_for_the_next():
    # key 1: a weight; 2: the previous step's gradient; this step makes 3 (a temporary) and 4 (its gradient)
    steady = [("alloc", 1, 8), ("alloc", 2, 4), ("alloc", 3, 16), ("free", 2, 0), ("alloc", 4, 4), ("free", 3, 0)]
    assert repeated_step(_log(*steady), 2, 6, 5) == _log(("alloc", 5, 16), ("free", 4, 0), ("alloc", 6, 4),
                                                         ("free", 5, 0))
    # a step that leaves for the next step other bytes than the step before it left for it is not steady
    for unsteady in (steady[:5] + [("free", 4, 0)], steady[:4] + [("alloc", 4, 8), ("free", 3, 0)]):
        with pytest.raises(NotSteady):
            repeated_step(_log(*unsteady), 2, 6, 5)


def test_a_step_that_is_not_steady_is_replayed_from_traces_that_run_every_step(two_warmup_steps, monkeypatch):
    """A step that keeps one storage more from the third step on (made here by wrapping the session's step): the
    smaller traces' repeated steps fail the proof; they run again with every step, the model and strategy are marked
    unsteady, and the row is the full trace's."""
    from bench.run.session import Session

    step = Session.step

    def third_step_keeps_more(session, *args, **kwargs):
        session.steps_run = getattr(session, "steps_run", 0) + 1
        if session.steps_run == 3:
            session.kept_from_the_third = torch.empty(1024, device="cuda")
        return step(session, *args, **kwargs)

    monkeypatch.setattr(Session, "step", third_step_keeps_more)
    monkeypatch.setattr(layer_replay, "UNSTEADY", set())
    case = Case("hf:llama-3.2-1b:seq_len=64:layers=6", "lora", "train", 2, "cuda")
    replayed = predict.predict_case(case, engine="fake-cuda")
    assert "layer replay: traced at 3, 4 and 5 layers" in replayed["message"], replayed["message"]
    assert layer_replay.UNSTEADY == {("hf:llama-3.2-1b:layers=6", "lora", "fake-cuda", 1, None)}
    monkeypatch.setenv(layer_replay.FULL_TRACE_ENV, "1")
    full = predict.predict_case(case, engine="fake-cuda")
    figures = [name for name in full if name != "message"]
    assert {name: replayed[name] for name in figures} == {name: full[name] for name in figures}


@pytest.mark.parametrize("spec, ranks", [("checkpoint:segments=all", 1), ("fsdp+checkpoint:segments=all", 3)])
def test_a_plan_candidate_from_repeated_steps_has_every_figure_of_the_full_trace(spec, ranks, two_warmup_steps,
                                                                                monkeypatch):
    """A plan candidate's time comes from its smaller traces' operator totals: where a trace's measured step is
    repeated, the operators of the warm-up step it repeats are counted (`plan_replay`), and the row is the full
    trace's."""
    from bench.analysis import plan, plan_replay

    from .test_plan_layer_replay_fake_cuda import FIGURES, TIME_COLUMNS, _request

    monkeypatch.setattr(plan_replay, "REPLAY_REFUSED", {})
    monkeypatch.setattr(layer_replay, "UNSTEADY", set())
    replayed = plan.evaluate(_request(ranks), spec, len(spec.split("+")), FIGURES, may_stop=True)
    monkeypatch.setenv(layer_replay.FULL_TRACE_ENV, "1")
    full = plan.evaluate(_request(ranks), spec, len(spec.split("+")), FIGURES, may_stop=True)
    assert "operator totals and time extrapolated" in replayed["message"], replayed["message"]
    assert not layer_replay.UNSTEADY and replayed["step_ops"] > 0
    exact = [name for name in full if name != "message" and name not in TIME_COLUMNS]
    assert {name: replayed[name] for name in exact} == {name: full[name] for name in exact}
    for name in TIME_COLUMNS:
        assert math.isclose(replayed[name], full[name], rel_tol=1e-9, abs_tol=0.0), name
