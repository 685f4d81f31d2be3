"""`plan`'s step time of a sharded candidate counts its collectives: each one recorded with its payload and group as it
arrives under PyTorch's fake process group (`bench.measure.op_cost`), costed by NCCL's ring model over the GPU link
inside a node and the network across nodes (`bench.analysis.plan_cost`), added to the compute without overlap. On
tiny models on the CPU, timed against an H100's published figures."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from bench.analysis import plan, plan_cost
from bench.core import gpus
from bench.measure.op_cost import (ALL_GATHER, ALL_REDUCE, BROADCAST, COLLECTIVE, MATMUL, REDUCE_SCATTER,
                                   OperatorCostCounter, step_totals)
from bench.run.ranks import fake_process_group

H100 = plan_cost.gpu_figures(gpus.find_gpu("H100 80GB"))
GPT = "gpt_mini:layers=2:width=32:heads=2:seq_len=16:dropout=0.0"
TINY_LLAMA = "hf:tiny-llama:seq_len=16"  # 4 heads, 2 key/value heads: tp degree 2


def _row(spec: str, ranks: int, gpus_per_node: int = 8, workload: str = GPT, data: str = "synthetic",
         figures: plan_cost.DeviceFigures = H100):
    request = plan.PlanRequest(workload, data, 4, "cpu", "H100 80GB", 2**40, 0, plan_cost.to_json(figures),
                               ranks=ranks, gpus_per_node=gpus_per_node)
    row = plan.evaluate(request, spec, 1, figures)
    assert row["status"] == "ok", row["message"]
    return row


def _model_parameters():
    from workloads import get_workload

    return list(get_workload(GPT).build_model().parameters())


def test_each_collective_is_recorded_with_its_payload_and_group_and_a_wait_is_not():
    """Payloads as nccl-tests counts them (the whole array), known by arithmetic: 4 ranks, float32."""
    import torch.distributed._functional_collectives as functional

    counter = OperatorCostCounter()
    with fake_process_group(4, 1):
        pair = dist.new_group([0, 1])
        shard, gathered, scattered, three, square = torch.ones(8), torch.empty(32), torch.empty(2), torch.ones(3), \
            torch.ones(2, 2)
        with counter:
            dist.all_gather_into_tensor(gathered, shard)  # out: 4 x 8 floats
            dist.reduce_scatter_tensor(scattered, shard)  # in: 8 floats
            dist.all_reduce(shard, group=pair)
            dist.broadcast(shard, 0)
            functional.wait_tensor(functional.all_reduce(three, "sum", pair))  # DTensor's kind
            torch.mm(square, square)
        counter.end_step()
    (ops,) = counter.steps
    found = [(op.collective, op.bytes, op.group_ranks) for op in ops if op.kind == COLLECTIVE]
    assert found == [(ALL_GATHER, 128, (0, 1, 2, 3)), (REDUCE_SCATTER, 32, (0, 1, 2, 3)), (ALL_REDUCE, 32, (0, 1)),
                     (BROADCAST, 32, (0, 1, 2, 3)), (ALL_REDUCE, 12, (0, 1))]
    assert [op.kind for op in ops] == [COLLECTIVE] * 5 + [MATMUL]  # neither wait_tensor nor autograd's wrapper
    totals = step_totals(ops)
    assert totals["collective_bytes"] == 128 + 32 + 32 + 32 + 12
    assert totals["bytes"] == 3 * 16  # the matmul's traffic only: a collective is no memory traffic
    assert totals["flops"] == 2 * 2**3


def test_the_ring_factors_over_the_link_the_group_crosses():
    """nccl-tests' bus factors: (n-1)/n for an all-gather, 2(n-1)/n for an all-reduce; the GPU link (450 GB/s each
    way on an H100) where the group is inside one node, the network (50 GB/s a GPU) where it spans two."""
    from bench.measure.op_cost import OpCost

    gather = OpCost(COLLECTIVE, "float32", 0, 4 * 10**9, ALL_GATHER, (0, 1, 2, 3))
    reduce = OpCost(COLLECTIVE, "float32", 0, 10**9, ALL_REDUCE, (0, 1))
    latency = gpus.COLLECTIVE_LATENCY_S
    assert H100.collective_seconds(gather, 8) == pytest.approx(latency + 4e9 * 3 / 4 / 450e9)
    assert H100.collective_seconds(reduce, 8) == pytest.approx(latency + 1e9 * 2 * 1 / 2 / 450e9)
    assert H100.collective_seconds(gather, 2) == pytest.approx(latency + 4e9 * 3 / 4 / 50e9)  # nodes {0,1}, {2,3}
    assert H100.collective_seconds(reduce, 2) == pytest.approx(latency + 1e9 / 450e9)  # ranks 0, 1: one node
    lone = OpCost(COLLECTIVE, "float32", 0, 10**9, ALL_REDUCE, (3,))
    assert H100.collective_seconds(lone, 8) == 0.0
    assert plan_cost.nodes_spanned((0, 8, 16), 8) == 3 and plan_cost.nodes_spanned((8, 15), 8) == 1


@pytest.fixture(scope="module")
def fsdp_rows():
    """fsdp on 2 ranks, both in one node (8 a node) and one a node (--gpus-per-node 1)."""
    return _row("fsdp", 2, 8), _row("fsdp", 2, 1)


def test_a_two_rank_fsdp_step_counts_its_all_gathers_and_reduce_scatters_over_nvlink(fsdp_rows):
    inside, _ = fsdp_rows
    payload, comm_s = inside["step_collective_bytes"], inside["est_comm_time_ms"] / 1e3
    # FSDP2 all-gathers every parameter in the forward and reduce-scatters every gradient: at least twice the model
    parameter_bytes = 4 * sum(p.numel() for p in _model_parameters())
    assert payload >= 2 * parameter_bytes
    # every collective of 2 ranks is an all-gather or reduce-scatter, factor (2-1)/2, over NVLink's 450 GB/s; the
    # rest is one latency each
    collectives = (comm_s - payload * 0.5 / 450e9) / gpus.COLLECTIVE_LATENCY_S
    assert collectives == pytest.approx(round(collectives), abs=1e-6) and round(collectives) >= 2
    assert inside["est_step_time_ms"] > inside["est_comm_time_ms"] > 0


def test_the_same_group_one_rank_a_node_is_slower_by_the_link_ratio(fsdp_rows):
    inside, across = fsdp_rows
    assert across["step_collective_bytes"] == inside["step_collective_bytes"]
    compute_ms = inside["est_step_time_ms"] - inside["est_comm_time_ms"]
    assert across["est_step_time_ms"] - across["est_comm_time_ms"] == pytest.approx(compute_ms)
    payload = inside["step_collective_bytes"]
    latency_ms = (inside["est_comm_time_ms"] - payload * 0.5 / 450e9 * 1e3)
    # the bandwidth part grows by NVLink / network = 450 / 50; the latencies stay
    assert (across["est_comm_time_ms"] - latency_ms) / (inside["est_comm_time_ms"] - latency_ms) == pytest.approx(9)


def test_a_one_rank_candidate_has_no_collective_and_its_time_is_its_compute():
    """Links no one could use (1 B/s, a second a collective) leave a one-rank estimate exactly as it is."""
    absurd = dataclasses.replace(H100, peer_link_bytes_per_s=1.0, network_bytes_per_s=1.0, collective_latency_s=1.0)
    row = _row("baseline", 1)
    assert row["est_comm_time_ms"] == 0 and row["step_collective_bytes"] == 0
    assert _row("baseline", 1, figures=absurd)["est_step_time_ms"] == row["est_step_time_ms"]
    assert _row("fsdp", 2, figures=absurd)["est_comm_time_ms"] > 1e3  # while a sharded one pays them


def test_a_dp_x_tp_mesh_counts_its_tensor_parallel_collectives_inside_a_node():
    """fsdp+tp on 4 ranks (2 dp x 2 tp): the tp groups are consecutive ranks (0, 1), the dp groups (0, 2). With 8 a
    node both sit in one; with 2 a node the dp group crosses the network; with 1 a node the tp group does too."""
    rows = {per_node: _row("tp:degree=2+fsdp", 4, per_node, TINY_LLAMA, "text") for per_node in (8, 2, 1)}
    assert len({row["step_collective_bytes"] for row in rows.values()}) == 1
    # 8 -> 2 a node: the dp groups' collectives (FSDP's) cross the network; 2 -> 1: so do the tp groups' (DTensor's)
    assert rows[8]["est_comm_time_ms"] < rows[2]["est_comm_time_ms"] < rows[1]["est_comm_time_ms"]


def test_a_two_rank_ddp_step_counts_its_bucket_all_reduces():
    """DDP's gradient buckets are all-reduced on the fake process group too (its comm hook issues them there): every
    gradient once, at 2(2-1)/2 = 1 byte over the link per byte; its buffers' broadcasts, factor 1 as well."""
    row = _row("ddp", 2)
    payload = row["step_collective_bytes"]
    assert payload >= 4 * sum(p.numel() for p in _model_parameters())
    collectives = (row["est_comm_time_ms"] / 1e3 - payload / 450e9) / gpus.COLLECTIVE_LATENCY_S
    assert collectives == pytest.approx(round(collectives), abs=1e-6) and round(collectives) >= 1
