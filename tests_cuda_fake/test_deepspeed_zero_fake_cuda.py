"""DeepSpeed ZeRO-2/3 as membench models them (strategies/framework/deepspeed_zero.py) on fake CUDA: each rank of a
2-rank run in turn in this one process, in PyTorch's fake process group restricted to CUDA tensors as NCCL is, through
the runner's CUDA branch. Asserted: the row's status; ZeRO-3's ranks holding the same; optimizer offload moving the
float32 masters, the optimizer state and the float32 gradients to the host (counted in `offload_host_peak_bytes`,
off the GPU's peak), and ZeRO-3's parameter offload its 16-bit partitions; the offloaded step's collectives all on
the GPU (the fake group refuses a host tensor, as NCCL does)."""

from __future__ import annotations

import pytest

from bench.run.case import Case
from bench.run.isolation import RunOptions
from bench.run.ranks import fake_process_group
from bench.run.runner import run_case
from strategies import STRATEGIES
from tests_cuda_fake.fake_mode import fake_cuda

RANKS = 2
WORKLOAD = "deep_mlp:layers=16:width=128"  # equal layers: ZeRO-3 gathers one at a time
ZERO2, ZERO3 = STRATEGIES.get("zero2").test_spec, STRATEGIES.get("zero3").test_spec


def _rows(spec: str) -> list[dict]:
    case = Case(WORKLOAD, spec, "train", 4, "cuda", data="synthetic", warmup=0, steps=1)
    rows = []
    for rank in range(RANKS):
        with fake_cuda(), fake_process_group(RANKS, rank, device="cuda"):
            row = run_case(case, None, RunOptions(threads=1, ranks=RANKS), verify_result=False)
        assert row["status"] == "ok", f"{spec} rank {rank}: {row['message']}"
        assert row["memory_method"] == "cuda_max_memory_allocated" and row["peak_mem_bytes"] > 0
        rows.append(row)
    return rows


@pytest.mark.parametrize("spec", [ZERO2, ZERO3, f"bf16_weights+{ZERO3}"])
def test_each_rank_runs_and_zero3s_ranks_hold_the_same(spec):
    """ZeRO-3 gives every rank ceil(numel / N) elements of every parameter, so on equal shares of the batch the
    ranks' peaks are equal (its `rank_signature`: a prediction traces one rank for all)."""
    rows = _rows(spec)
    if "zero3" in spec:
        assert rows[0]["peak_mem_bytes"] == rows[1]["peak_mem_bytes"]


@pytest.mark.parametrize("base", [ZERO2, ZERO3])
def test_offload_moves_the_masters_and_the_optimizer_state_to_the_host(base):
    """Optimizer offload takes the float32 masters, Adam's moments and the step's float32 gradients off the GPU (the
    host holds them: `offload_host_peak_bytes`); ZeRO-3's parameter offload takes its 16-bit partitions too."""
    on_gpu, offloaded = _rows(base), _rows(f"{base}:offload_optimizer=cpu")
    for kept, moved in zip(on_gpu, offloaded):
        assert moved["offload_host_peak_bytes"] > 0 and not kept.get("offload_host_peak_bytes")
        assert moved["peak_mem_bytes"] < kept["peak_mem_bytes"]
    if "zero3" in base:
        for optimizer_only, both in zip(offloaded, _rows(f"{base}:offload_optimizer=cpu:offload_param=cpu")):
            assert both["peak_mem_bytes"] < optimizer_only["peak_mem_bytes"]
            assert both["offload_host_peak_bytes"] > optimizer_only["offload_host_peak_bytes"]
