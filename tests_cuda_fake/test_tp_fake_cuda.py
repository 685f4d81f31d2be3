"""Tensor parallelism (`tp:degree=2`, strategies/tp.py) on fake CUDA, predicted per rank in one process (PyTorch's fake
process group restricted to CUDA tensors, as NCCL is): each rank holds half of every split parameter and all of each
norm, on the GPU; its DTensor redistributions and collectives allocate communication buffers in the forward and the
backward; sequence and loss parallelism lower the per-rank activations and logits; `fsdp+tp` on a 2 x 2 mesh halves
the optimizer state again. Every expected figure is counted from the model's parameters. Real CPU ranks against the
same one-process prediction, to the byte: tests/test_tp.py."""

from __future__ import annotations

import pytest
import torch

from bench.analysis.fake_engine import tracked_step
from bench.core.memory_categories import COMMUNICATION
from bench.run.case import Case
from workloads import get_workload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs the fake-CUDA environment's torch")
pytest.importorskip("transformers")

LLAMA = "hf:tiny-llama:seq_len=16"  # 4 attention heads, 2 key/value heads: degree 2 divides them
NEITHER = "tp:degree=2:sequence_parallel=false:loss_parallel=false"


def _step(spec: str, ranks: int = 2):
    case = Case(LLAMA, spec, "train", 4, "cuda", data="synthetic")
    return tracked_step(case, spec, "fake-cuda", ranks=ranks, record_events=True, warmup_steps=1)


def _communication_stages(step) -> set[str]:
    window = max(i for i, event in enumerate(step.events) if event.kind == "reset")
    return {event.stage for event in step.events[window:]
            if event.kind == "alloc" and event.category == COMMUNICATION}


def _split_and_norm_elements() -> tuple[int, int]:
    model = get_workload(LLAMA).model_structure()
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    return sum(p.numel() for p in model.parameters()) - norms, norms


def test_each_rank_holds_its_half_and_its_collectives_buffers_on_the_gpu():
    step = _step("tp:degree=2")
    split, norms = _split_and_norm_elements()
    assert step.engine == "fake-cuda" and step.ranks_traced == (0,)  # equal shards and batch: one rank of each
    assert step.peak_by_category["params"] == 4 * (split // 2 + norms)
    assert {"forward", "backward"} <= _communication_stages(step)


def test_sequence_and_loss_parallelism_lower_the_activations_and_the_logits():
    both, neither = _step("tp:degree=2"), _step(NEITHER)
    assert both.peak_bytes < neither.peak_bytes
    assert both.peak_by_category.get("logits", 0) < neither.peak_by_category.get("logits", 0)


def test_fsdp_over_the_data_parallel_dimension_halves_the_optimizer_state_again():
    alone, composed = _step("tp:degree=2"), _step("fsdp+tp:degree=2", ranks=4)
    assert composed.ranks_traced == (0,)  # FSDP's chunks of the tp shards are even too
    assert 0 < composed.peak_by_category["optimizer_state"] < 0.55 * alone.peak_by_category["optimizer_state"]
    assert composed.peak_by_category[COMMUNICATION] > 0
