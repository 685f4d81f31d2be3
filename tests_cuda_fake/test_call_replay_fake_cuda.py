"""Call replay (bench/measure/call_replay.py): a QLoRA step whose NF4 dequantisations are replayed per weight layout
logs what the step that runs every one of them logs, event for event and byte for byte, with the same peak and
bytes by category, and the same prediction; a call is replayed only where nothing but the tracker watches."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from bench.analysis import layer_replay, predict
from bench.analysis.fake_engine import PredictionMeter, bound_device, tracked_step
from bench.measure import call_replay, cuda_allocator
from bench.measure.fake_allocator import FakeAllocator
from bench.measure.fake_cuda_mode import fake_cuda
from bench.measure.memory import LiveTensorTracker
from bench.measure.sdpa_kernel import SdpaCalls
from bench.run.case import Case, bind_case
from bench.run.ranks import fake_process_group

from .conftest import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

SMALL = "hf:llama-3.2-1b:seq_len=64:layers=2"


def _step(case: Case, ranks: int = 1):
    group = fake_process_group(ranks, 0, device="cuda") if ranks > 1 else contextlib.nullcontext()
    with group:
        planned = bind_case(replace(case, device=bound_device("fake-cuda")), ranks)[0]
        planned.plan(PredictionMeter(case))
        return tracked_step(case, case.strategy, "fake-cuda", 1, ranks=ranks, record_events=True, planned=planned)


def _replays(monkeypatch) -> list:
    """The calls replayed from now on, counted."""
    replays = []
    replay = call_replay._replay
    monkeypatch.setattr(call_replay, "_replay", lambda *a: replays.append(1) or replay(*a))
    return replays


@pytest.mark.parametrize("spec, ranks", [
    ("bf16_weights+qlora+checkpoint", 1),
    ("qlora:scaler_block=8+checkpoint:segments=all", 1),  # float32 weights: a copy to the input's dtype after each
    ("qlora", 1),
    ("bf16_weights+qlora+checkpoint:segments=all+fsdp", 2),  # rank 0's: the weights all-gathered before each use
])
def test_a_replayed_dequantisation_logs_what_it_logs_when_it_runs(spec, ranks, monkeypatch):
    case = Case(SMALL, spec, "train", 2, "cuda")
    replays = _replays(monkeypatch)
    replayed = _step(case, ranks)
    assert replays, "no dequantisation was replayed"
    monkeypatch.setenv(layer_replay.FULL_TRACE_ENV, "1")
    count = len(replays)
    full = _step(case, ranks)
    assert len(replays) == count  # none replayed with MEMBENCH_FULL_TRACE=1
    assert replayed.events == full.events
    assert replayed.peak_bytes == full.peak_bytes and replayed.tracker.peak_stage == full.tracker.peak_stage
    assert replayed.peak_by_category == full.peak_by_category
    assert cuda_allocator.replay(layer_replay.measured_log(replayed.events)) == \
        cuda_allocator.replay(layer_replay.measured_log(full.events))


def test_a_full_size_qlora_prediction_is_the_same_with_every_call_run(monkeypatch):
    case = Case("hf:llama-3.2-1b:seq_len=256:layers=7", "bf16_weights+qlora+checkpoint", "train", 1, "cuda")
    replays = _replays(monkeypatch)
    replayed = predict.predict_case(case, engine="fake-cuda")
    assert replays
    monkeypatch.setenv(layer_replay.FULL_TRACE_ENV, "1")
    full = predict.predict_case(case, engine="fake-cuda")
    figures = [name for name in full if name != "message"]
    assert {name: replayed[name] for name in figures} == {name: full[name] for name in figures}


def _double_then_sum(t):
    return (t * 2).sum(0)


def test_a_call_is_replayed_under_the_recording_tracker_only():
    tracker = LiveTensorTracker("cuda", record_events=True)
    with fake_cuda(FakeAllocator(counted_by=tracker)):
        x = torch.ones(64, 32, device="cuda")
        with tracker:
            assert call_replay.recording_tracker((x,)) is tracker
            tracker.track([x], "batch")
            start = len(tracker.events)
            first = call_replay.replayed_call(tracker, "double-sum", lambda: _double_then_sum(x), (x,))
            middle = len(tracker.events)
            second = call_replay.replayed_call(tracker, "double-sum", lambda: pytest.fail("ran"), (x,))
            recorded, replayed = tracker.events[start:middle], tracker.events[middle:]
            assert [event.kind for event in recorded] == ["op", "alloc", "op", "alloc", "free"]
            assert replayed == [event._replace(key=event.key + 2) if event.key else event for event in recorded]
            assert (second.shape, second.stride(), second.dtype) == (first.shape, first.stride(), first.dtype)
            assert tracker.live_bytes == 64 * 32 * 4 + 2 * 32 * 4 and tracker.peak_bytes == 2 * 64 * 32 * 4 + 2 * 32 * 4
            x.requires_grad_()
            assert call_replay.recording_tracker((x,)) is None  # a gradient to record
            x.requires_grad_(False)
        assert call_replay.recording_tracker((x,)) is None  # no tracker
        with LiveTensorTracker("cuda", record_events=False):
            assert call_replay.recording_tracker((x,)) is None  # no event log
        with tracker, LiveTensorTracker("cuda", record_events=True):
            assert call_replay.recording_tracker((x,)) is None  # another tracker watching
        with tracker, _EveryCall():
            assert call_replay.recording_tracker((x,)) is None  # a function mode that sees every call
        with tracker, SdpaCalls():
            assert call_replay.recording_tracker((x,)) is tracker  # one that sees attention calls alone


class _EveryCall(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))
