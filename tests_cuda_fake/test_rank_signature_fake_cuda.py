"""On fake CUDA, two FSDP2 ranks whose `rank_signature`s are equal allocate the same, through the caching allocator's
model too: the per-rank prediction traces one of them (bench.analysis.fake_engine.tracked_step)."""

from __future__ import annotations

import pytest
import torch

from bench.analysis.fake_engine import tracked_step
from bench.measure import cuda_allocator
from bench.run.ranks import fake_process_group
from bench.run.case import Case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs the fake-CUDA environment's torch")

WORKLOAD = "gpt_mini:layers=2:width=32:heads=2:seq_len=16:dropout=0.0"


@pytest.mark.parametrize("spec", ["fsdp", "fsdp+checkpoint"])
def test_equal_signatures_replay_to_the_same_allocated_and_reserved_bytes(spec):
    case = Case(workload=WORKLOAD, strategy=spec, phase="train", batch_size=4, device="cuda")
    options = {"ranks": 2, "record_events": True, "warmup_steps": 2}
    shortcut = tracked_step(case, spec, "fake-cuda", **options)
    assert shortcut.ranks_traced == (0,) and shortcut.rank == 0
    with fake_process_group(2, 1, device="cuda"):
        second = tracked_step(case, spec, "fake-cuda", **options)  # the rank the shortcut did not trace
    assert second.rank_signatures[1] == shortcut.rank_signatures[0]
    first, other = (cuda_allocator.replay(step.events) for step in (shortcut, second))
    assert (first.max_allocated_bytes, first.max_reserved_bytes) == (other.max_allocated_bytes,
                                                                      other.max_reserved_bytes)
    assert first.peak_by_category == other.peak_by_category
    assert shortcut.peak_bytes == second.peak_bytes
