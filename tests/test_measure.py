"""The measurement primitives, on cases whose answer is known by arithmetic."""


import pytest
import torch

from bench.measure import timing
from bench.measure.memory import LiveTensorTracker


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


def test_tracker_finds_tensors_in_lists_of_arguments_and_of_results():
    """A multi-tensor operator (the foreach optimizers' kind) takes and returns lists: tensors made before the tracker
    that reach it only in a list are counted once (as untracked), and each tensor of a returned list is counted."""
    before = [torch.zeros(100), torch.zeros(200)]  # 1,200 bytes the tracker never saw made
    with LiveTensorTracker() as tracker:
        sums = torch._foreach_add(before, 1.0)  # +1,200 in a list
        stacked = torch.cat(before)  # +1,200; its inputs already known: no more
        assert tracker.live_by_category == {"untracked": 1_200, "setup": 2_400}
        del sums
        assert tracker.live_bytes == 2_400
    del stacked


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
    stats = timing.TimingStats([1.0, 2.0, 3.0, 4.0, 100.0])
    assert stats.median_ms == 3.0
    assert stats.iqr_ms == pytest.approx(2.0)
    assert stats.min_ms == 1.0


class FakeSteps:
    """A step function on a fake clock: each step advances it by the next of `durations_s` (repeated as needed)."""

    def __init__(self, durations_s):
        self.durations_s = list(durations_s)
        self.now = 0.0
        self.calls = 0

    def clock(self) -> float:
        return self.now

    def step(self) -> None:
        self.now += self.durations_s[self.calls % len(self.durations_s)]
        self.calls += 1


def test_fixed_steps_are_exact_whatever_the_noise_and_budget():
    fake = FakeSteps([0.1, 5.0, 0.2])  # noisy, and far beyond any budget: a fixed count ignores both
    policy = timing.TimingPolicy(warmup=2, steps=5, min_steps=1, max_time_s=0.001, target_ci_rel=0.5)
    stats = timing.time_steps(fake.step, policy, "cpu", clock=fake.clock)
    assert fake.calls == 7 and len(stats.times_ms) == 5 and stats.stop_reason == "fixed_steps"
    assert stats.times_ms[:3] == pytest.approx([200.0, 100.0, 5000.0])  # after the 2 warm-up steps


def test_adaptive_timing_stops_at_the_minimum_when_steady():
    fake = FakeSteps([1.0])  # identical steps: the interval has zero width as soon as it exists (6 steps at 95%)
    policy = timing.TimingPolicy(warmup=1, steps=None, min_steps=8, max_time_s=1000.0, target_ci_rel=0.05)
    stats = timing.time_steps(fake.step, policy, "cpu", clock=fake.clock)
    assert len(stats.times_ms) == 8 and stats.stop_reason == "ci_target" and fake.calls == 9


def test_adaptive_timing_needs_six_steps_for_an_interval():
    fake = FakeSteps([1.0])
    policy = timing.TimingPolicy(warmup=0, steps=None, min_steps=1, max_time_s=1000.0, target_ci_rel=0.05)
    stats = timing.time_steps(fake.step, policy, "cpu", clock=fake.clock)
    assert len(stats.times_ms) == 6 and stats.stop_reason == "ci_target"


def test_adaptive_timing_runs_to_the_budget_when_noisy():
    fake = FakeSteps([1.0, 2.0])  # alternating: the median's interval stays [1, 2], 67% of the median
    policy = timing.TimingPolicy(warmup=1, steps=None, min_steps=3, max_time_s=30.0, target_ci_rel=0.05)
    stats = timing.time_steps(fake.step, policy, "cpu", clock=fake.clock)
    assert stats.stop_reason == "time_budget"
    assert sum(stats.times_ms) / 1e3 == pytest.approx(30.0)  # 20 steps: the one that reaches 30 s is the last
    assert len(stats.times_ms) == 20


def test_the_budget_never_cuts_below_the_minimum():
    fake = FakeSteps([83.0])  # one emulated bfloat16 step at batch 100 is longer than the whole budget
    policy = timing.TimingPolicy(warmup=1, steps=None, min_steps=2, max_time_s=15.0, target_ci_rel=0.05)
    stats = timing.time_steps(fake.step, policy, "cpu", clock=fake.clock)
    assert len(stats.times_ms) == 2 and stats.stop_reason == "time_budget"


def test_median_interval_from_order_statistics():
    assert timing.median_ci_ranks(5) is None  # 1 - 2/32 < 95%: no interval yet
    assert timing.median_ci_ranks(6) == (1, 6)  # 1 - 2/64 = 96.9%
    assert timing.median_ci_ranks(20) == (6, 15)  # P(B(20, 1/2) <= 5) = 2.07% -> 95.9%
    assert timing.median_ci_ranks(1000) == (469, 532)  # the normal approximation
    assert timing.median_ci(list(range(20, 0, -1))) == (6, 15)
    assert timing.median_ci_rel_width([10.0] * 5 + [11.0]) == pytest.approx(0.1)


def test_tracker_follows_a_storage_resized_in_place():
    """FSDP2 frees each unit's all-gathered parameters with `untyped_storage().resize_(0)` after its forward and
    reallocates them with `resize_(n)` before its backward, the storage object living on: the count (and the event log
    the allocator model replays) must follow, or every unit's full weights stay counted for the whole step."""
    from bench.measure.cuda_allocator import replay

    with LiveTensorTracker(record_events=True) as tracker:
        t = torch.empty(1024, dtype=torch.float32)  # 4 KiB
        start = tracker.live_bytes
        t.untyped_storage().resize_(0)
        assert tracker.live_bytes == start - 4096
        t.untyped_storage().resize_(2048 * 4)  # 8 KiB, a new block
        assert tracker.live_bytes == start + 4096
        assert tracker.peak_bytes == start + 4096
        del t
        assert tracker.live_bytes == start - 4096
    kinds = [(e.kind, e.nbytes) for e in tracker.events if e.kind in ("alloc", "free")]
    assert kinds == [("alloc", 4096), ("free", 0), ("alloc", 8192), ("free", 0)]
    replay(tracker.events)  # every block freed once: the allocator model accepts the log
    # outside any tracker, a resize is a resize
    u = torch.empty(4)
    u.untyped_storage().resize_(0)
    assert u.untyped_storage().nbytes() == 0


def test_tracker_bookkeeping_is_its_live_storages_not_every_storage_it_has_seen():
    # a pass registers every storage of its steps (deep_mlp's 1000 layers: tens of thousands a step); each one's
    # weak reference, callback and record used to stay in a list after its storage was freed (17 MiB of deep_mlp's
    # memory pass, against its 11 MiB counted peak)
    import tracemalloc

    kept = torch.ones(10)
    with LiveTensorTracker() as tracker:
        for _ in range(200):  # warm: the dispatcher's own caches
            torch.ones(4) * 2
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(20_000):
                torch.ones(4) * 2
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        live = torch.ones(100)
        assert tracker.live_bytes == 400  # `live` only: `kept` was never an operator's input
    assert grown < 256 * 1024, f"{grown} bytes kept for 40,000 freed storages"
    del kept, live
