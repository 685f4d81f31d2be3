"""On fake CUDA, FSDP2 with a mixed-precision policy (`fsdp:param_dtype=bfloat16:reduce_dtype=float32`) against plain
FSDP2 on the same float32 model, predicted per rank in one process: its all-gathers carry bfloat16 (half the bytes
of every parameter), its reduce-scatters still float32, and the weights at the peak are the float32 shards plus the
units in flight at 2 bytes a parameter instead of 4, with and without FSDP2's CPU offload. Every figure expected is
counted from the model's parameters."""

from __future__ import annotations

import pytest
import torch

from bench.analysis.fake_engine import tracked_step
from bench.core.memory_categories import COMMUNICATION
from bench.run.case import Case
from workloads import get_workload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs the fake-CUDA environment's torch")

# units of 3 M parameters, every dimension even: the shards of 2 ranks are halves, no padding
WORKLOAD = "gpt_mini:layers=3:width=512:heads=4:seq_len=64:dropout=0.0"
RANKS = 2
MIXED = "param_dtype=bfloat16:reduce_dtype=float32"


def _step(spec: str):
    case = Case(workload=WORKLOAD, strategy=spec, phase="train", batch_size=4, device="cuda")
    return tracked_step(case, spec, "fake-cuda", ranks=RANKS, record_events=True, warmup_steps=1)


def _communication_allocations(step, stage: str) -> list[int]:
    """The bytes of each collective buffer the measured step allocates in `stage`."""
    window = max(i for i, event in enumerate(step.events) if event.kind == "reset")
    return [event.nbytes for event in step.events[window:]
            if event.kind == "alloc" and event.category == COMMUNICATION and event.stage == stage]


def _parameter_counts() -> tuple[int, int, int]:
    """The model's parameters, those of its root alone (outside every checkpoint unit: embeddings, final norm) and
    those of its largest unit (a transformer block)."""
    workload = get_workload(WORKLOAD)
    model = workload.model_structure()
    units = [sum(p.numel() for p in unit.parameters()) for unit in workload.checkpoint_units(model)]
    total = sum(p.numel() for p in model.parameters())
    return total, total - sum(units), max(units)


@pytest.mark.parametrize("offload", [False, True])
def test_mixed_precision_all_gathers_bfloat16_and_holds_half_the_unsharded_weights(offload):
    options = ":offload=cpu" if offload else ""
    plain, mixed = _step(f"fsdp{options}"), _step(f"fsdp{options}:{MIXED}")
    total, root, block = _parameter_counts()

    # the forward all-gathers every parameter once: 4 bytes each in float32, 2 in bfloat16
    assert sum(_communication_allocations(plain, "forward")) == 4 * total
    assert sum(_communication_allocations(mixed, "forward")) == 2 * total
    # the backward's largest buffer is a block's flat reduce-scatter input: float32 in both (reduce_dtype)
    assert max(_communication_allocations(mixed, "backward")) == 4 * block
    assert max(_communication_allocations(plain, "backward")) == 4 * block

    # at the backward's peak: this rank's float32 shards (in host memory with offload) and, unsharded, the root's
    # parameters (FSDP2 keeps the root's from its forward to its backward) and one block's
    shards = 0 if offload else 4 * total // RANKS
    in_flight = root + block
    assert plain.peak_by_category["params"] == shards + 4 * in_flight
    assert mixed.peak_by_category["params"] == shards + 2 * in_flight
    # the per-rank peak drops by at least those 2 bytes a parameter in flight (the 16-bit activations drop too)
    assert plain.peak_bytes - mixed.peak_bytes >= 2 * in_flight
