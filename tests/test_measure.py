"""The measurement primitives, on cases whose answer is known by arithmetic."""

import warnings

import pytest
import torch

from bench import measure
from bench.measure import LiveTensorTracker


def test_tracker_counts_storages_exactly():
    root = torch.zeros(1000)  # 4,000 bytes that exist before the tracker
    with LiveTensorTracker() as tracker:
        tracker.track([root], "root")
        b = torch.ones(2000)  # +8,000
        c = b * 2  # +8,000 -> 20,000: the peak
        del b  # -8,000
        view = c.view(-1)  # a view: no new storage
        c.add_(1)  # in place: no new storage
        e = torch.empty(500)  # +2,000 -> 14,000
        assert tracker.live_bytes == 14_000
    assert tracker.peak_bytes == 20_000
    assert tracker.live_by_category == {"root": 4_000, "setup": 10_000}
    del view, e


def test_tracker_counts_tensors_saved_for_backward():
    w = torch.ones(1000, requires_grad=True)  # 4,000
    with LiveTensorTracker() as tracker:
        tracker.track([w], "params")
        tracker.stage = "forward"
        h = torch.sigmoid(w)  # +4,000, saved by SigmoidBackward for the backward pass
        z = h.sum()  # +4
        del h  # the graph still holds it
        assert tracker.live_bytes == 8_004
        tracker.stage = "backward"
        tracker.reset_peak()
        z.backward()  # gradient of sum (+4), sigmoid's input gradient (+4,000) becomes w.grad; h is released
    assert tracker.peak_bytes == 4_000 + 4_000 + 4 + 4 + 4_000
    assert tracker.peak_stage == "backward"
    assert tracker.live_bytes == 4_000 + 4 + 4_000  # w, z, w.grad


def test_tracker_ignores_other_devices():
    with LiveTensorTracker("cuda") as tracker:
        torch.ones(100)
    assert tracker.peak_bytes == 0


def test_tracker_timeline_marks_stages():
    with LiveTensorTracker(record_timeline=True) as tracker:
        tracker.stage = "forward"
        a = torch.ones(10)
        tracker.stage = "backward"
        b = a * 2
    assert [(p.stage, p.live_bytes) for p in tracker.timeline] == [("forward", 40), ("backward", 80)]
    del b


def test_timing_statistics():
    stats = measure.TimingStats([1.0, 2.0, 3.0, 4.0, 100.0])
    assert stats.median_ms == 3.0
    assert stats.iqr_ms == pytest.approx(2.0)
    assert stats.min_ms == 1.0


def test_time_steps_runs_warmup_then_measured_steps():
    calls = []
    stats = measure.time_steps(lambda: calls.append(1), warmup=2, steps=5, device="cpu")
    assert len(calls) == 7 and len(stats.times_ms) == 5


def test_train_step_peak_agrees_with_pytorch_memtracker():
    """The runner's CPU figure against an independent exact count: torch's own MemTracker, same step."""
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    from bench.runner import Case, Session, memory_pass
    from strategies import parse_strategy

    case = Case("captcha_resnet18", "baseline", "train", 4, "cpu", data="synthetic")
    ours = memory_pass(case, parse_strategy("baseline"))["peak_mem_bytes"]

    session = Session(case, parse_strategy("baseline"))
    for _ in range(2):
        session.step()
    tracker = mem_tracker.MemTracker()
    tracker.track_external(session.base_model, session.optimizer, session.x, session.y, *session.kept.values())
    with warnings.catch_warnings(), tracker:
        warnings.simplefilter("ignore")  # MemTracker warns about module hooks it skips
        session.step()
    theirs = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert abs(ours - theirs) <= 0.01 * theirs
    assert ours > 11_242_704 * 4 * 4  # at least params, grads and Adam's two moments
