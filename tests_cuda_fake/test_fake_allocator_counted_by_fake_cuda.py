"""The fake CUDA allocator beside a prediction's tracker (`FakeAllocator(counted_by=...)`): inside the tracker's window
the allocator leaves the operators to it and torch.cuda's statistics are the tracker's; outside it counts alone; and a
prediction's figures and event log are those of an allocator that counts every operator itself."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from bench.analysis import fake_engine
from bench.measure import fake_cuda_mode
from bench.measure.fake_allocator import FakeAllocator
from bench.measure.replay_log import frees_in_key_order
from bench.measure.memory import LiveTensorTracker
from bench.run.case import Case

MIB = 1 << 20


def test_inside_the_trackers_window_the_statistics_are_the_trackers_and_outside_the_allocators():
    tracker = LiveTensorTracker("cuda", block_bytes=512)
    allocator = FakeAllocator(limit_bytes=sys.maxsize, counted_by=tracker)
    with fake_cuda_mode.fake_cuda(allocator):
        before = torch.empty(MIB, dtype=torch.uint8, device="cuda")
        assert torch.cuda.memory_allocated() == allocator.live_bytes == MIB
        assert _get_current_dispatch_mode_stack()[-1] is allocator
        with tracker:
            # the allocator only passes operators on meanwhile: it is off the stack (bench.measure.mode_aside)
            assert allocator not in _get_current_dispatch_mode_stack()
            assert _get_current_dispatch_mode_stack()[-1] is tracker
            with tracker:  # entered again (a nested pass): nothing below it is another tracker's to set aside
                assert _get_current_dispatch_mode_stack()[-2:] == [tracker, tracker]
            tracker.track([before], "params")
            inside = torch.empty(2 * MIB, dtype=torch.uint8, device="cuda")
            assert allocator.live_bytes == MIB  # the operator was left to the tracker
            assert torch.cuda.memory_allocated() == tracker.live_bytes == 3 * MIB
            del inside
            assert torch.cuda.memory_allocated() == MIB
            assert torch.cuda.max_memory_allocated() == tracker.peak_bytes == 3 * MIB
            torch.cuda.reset_peak_memory_stats()  # the tracker's window is the measurement: its peak stays
            assert tracker.peak_bytes == 3 * MIB
        assert _get_current_dispatch_mode_stack()[-1] is allocator  # back under whatever comes next
        after = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
        assert torch.cuda.memory_allocated() == allocator.live_bytes == 5 * MIB
        del before, after


class _CountingEveryOperator(FakeAllocator):
    """The allocator as it was before `counted_by`: it registers every operator's tensors itself."""

    def __init__(self, limit_bytes=None, counted_by=None):
        super().__init__(limit_bytes)


@pytest.mark.parametrize("spec", ["baseline", "checkpoint+amp"])
def test_a_prediction_is_the_same_to_the_event_whether_the_allocator_counts_or_leaves_it_to_the_tracker(
        spec, monkeypatch):
    case = Case("gpt_mini", spec, "train", 2, "cuda")
    left_to_the_tracker = fake_engine.tracked_step(case, spec, "fake-cuda", record_events=True, warmup_steps=2)
    monkeypatch.setattr(fake_engine, "FakeAllocator", _CountingEveryOperator)
    counted_twice = fake_engine.tracked_step(case, spec, "fake-cuda", record_events=True, warmup_steps=2)
    assert left_to_the_tracker.peak_bytes == counted_twice.peak_bytes > 0
    assert left_to_the_tracker.peak_by_category == counted_twice.peak_by_category
    # a run of frees comes in an order no figure depends on (autocast's cache of casts: a hash table's), which the
    # objects the allocator no longer makes can change; the replay sorts each run (`frees_in_key_order`)
    assert frees_in_key_order(left_to_the_tracker.events) == frees_in_key_order(counted_twice.events)
