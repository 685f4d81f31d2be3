"""On fake CUDA, FSDP2 through membench's all-gather and reduce-scatter (which file their buffers as communication)
allocates what FSDP2 through its own default collectives allocates: the same allocated and reserved peaks, so the
filing changes the breakdown's labels and nothing else."""

from __future__ import annotations

import pytest
import torch

import strategies.fsdp as fsdp_strategy
from bench.analysis.fake_engine import tracked_step
from bench.core.memory_categories import COMMUNICATION
from bench.measure import cuda_allocator
from bench.run.case import Case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs the fake-CUDA environment's torch")

SMALL = "gpt_mini:layers=2:width=32:heads=2:seq_len=16:dropout=0.0"  # every block in the small pool
LARGE = "gpt_mini:layers=3:width=512:heads=4:seq_len=64:dropout=0.0"  # units of 3 MiB: the large pool's segments


def _fsdp_defaults():
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    return DefaultAllGather(), DefaultReduceScatter()


@pytest.mark.parametrize("workload, spec, ranks, communication_at_peak", [
    (SMALL, "fsdp", 2, True), (SMALL, "fsdp+checkpoint", 2, True),
    (SMALL, "fsdp:reshard_after_forward=false", 2, False),  # its peak is in the forward, no collective in flight
    (LARGE, "fsdp+checkpoint", 2, True), (LARGE, "fsdp", 3, True)])
def test_membench_collectives_allocate_as_fsdp2_defaults(workload, spec, ranks, communication_at_peak, monkeypatch):
    case = Case(workload=workload, strategy=spec, phase="train", batch_size=4, device="cuda")
    options = {"ranks": ranks, "record_events": True, "warmup_steps": 2}
    filed = tracked_step(case, spec, "fake-cuda", **options)
    monkeypatch.setattr(fsdp_strategy, "_communication_comms", _fsdp_defaults)
    default = tracked_step(case, spec, "fake-cuda", **options)
    ours, theirs = (cuda_allocator.replay(step.events) for step in (filed, default))
    assert (ours.max_allocated_bytes, ours.max_reserved_bytes) == (theirs.max_allocated_bytes,
                                                                    theirs.max_reserved_bytes)
    assert filed.peak_bytes == default.peak_bytes
    assert (ours.peak_by_category.get(COMMUNICATION, 0) > 0) == communication_at_peak  # the filing did happen
    assert theirs.peak_by_category.get(COMMUNICATION, 0) == 0
    assert sum(ours.peak_by_category.values()) == sum(theirs.peak_by_category.values())
