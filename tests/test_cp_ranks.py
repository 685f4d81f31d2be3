"""Context parallelism (`fsdp+cp:degree=2`, strategies/cp.py) on real gloo ranks on the CPU: PyTorch's ring attention,
with the CPU's attention kernel put in it (`_cpu_kernel_in_the_ring`), gives each rank the rows of causal attention
over the whole sequence, forward and backward; and a tiny Llama's training step on 2 ranks matches one process on the
global batch, each rank's live-tensor peak predicted in one process (PyTorch's fake process group, CPU engine) to
the byte, with its weights, gradients, optimizer state and communication, on 2 ranks and on a 2 x 2 dp x cp mesh.

Not checked here: the ring's operators inside the attention operator's DTensor dispatch (each step's partial output
and log-sum-exp, their merge), which no dispatch mode sees, the real ranks' live-tensor tracker no more than the
prediction's. PyTorch's allocator sees them (torch.profiler's memory events, `cpu_memory_count`): counted there
(set by a plug-in in the rank processes), the 2 ranks' peaks equalled the prediction's to the byte in 7 runs of 8,
and differed in one (its figures were not kept, its cause not found), so no test compares them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# each spawned rank imports this module: what only the model test needs is imported there

RANKS = 2
SPEC = "fsdp+cp:degree=2"
LLAMA = "hf:tiny-llama:seq_len=128"  # 64 tokens a rank, where the ring sets the peak (at 8 a rank it did not)


def _head_and_tail(tensor, rank: int):
    """This rank's chunks r and 2C-1-r of the sequence (dim 2), the order strategies/cp.py shards it in."""
    chunks = tensor.chunk(2 * RANKS, dim=2)
    return torch.cat([chunks[rank], chunks[2 * RANKS - 1 - rank]], dim=2)


def _ring_attention_rank(rank: int, init_file: str) -> None:
    """One gloo rank: the ring's causal attention on its shards against attention over the whole sequence."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel

    from strategies.cp import _cpu_kernel_in_the_ring

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=RANKS)
    try:
        torch.manual_seed(0)  # the same whole sequence on each rank
        q, k, v = (torch.randn(2, 4, 32, 8, requires_grad=True) for _ in range(3))
        whole = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        whole.square().sum().backward()
        mine = [_head_and_tail(t.detach(), rank).requires_grad_() for t in (q, k, v)]
        tokens = torch.zeros(1, 32)  # only its length counts: context_parallel shards it head and tail too
        with context_parallel(DeviceMesh("cpu", list(range(RANKS))), buffers=[tokens], buffer_seq_dims=[1]):
            with _cpu_kernel_in_the_ring():
                out = F.scaled_dot_product_attention(*mine, is_causal=True)
                out.square().sum().backward()
        torch.testing.assert_close(out, _head_and_tail(whole.detach(), rank))
        for local, full in zip(mine, (q, k, v)):
            torch.testing.assert_close(local.grad, _head_and_tail(full.grad, rank))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # 2 spawned ranks, each importing torch and the strategies: 14-21 s on 2 busy cores (5 s of CPU)
def test_the_ring_around_the_cpu_kernel_is_attention_over_the_whole_sequence(tmp_path):
    torch.multiprocessing.spawn(_ring_attention_rank, args=(str(tmp_path / "rendezvous"),), nprocs=RANKS)


def _case(ranks: int = RANKS):
    """2 samples a data-parallel group: on 4 ranks, 2 groups of 2 context-parallel ranks (a 2 x 2 mesh)."""
    from bench.run.case import Case

    return Case(LLAMA, SPEC, "train", 2 * ranks // RANKS, "cpu", data="synthetic", warmup=0, steps=1)


def _measured(ranks: int = RANKS) -> dict:
    """The real gloo ranks' row (`compare --ranks N --device cpu`)."""
    from bench.run.isolation import RunOptions
    from bench.run.runner import run_case

    measured = run_case(_case(ranks), env={}, options=RunOptions(threads=1, ranks=ranks))
    assert measured["status"] == "ok", measured["message"]
    assert measured["ranks"] == ranks and measured["matches_baseline"] is True, measured
    # the ring's work differs by rank (its load balance), and so do their peaks (equal without the ring): the
    # per-rank comparisons check the ring's allocations, not only FSDP's
    assert measured["rank_peak_min_bytes"] < measured["rank_peak_max_bytes"], measured
    return measured


def _predicted_steps(ranks: int = RANKS) -> tuple:
    """Each rank's tracked step, in turn in this process as that rank of PyTorch's fake process group (CPU engine)."""
    from bench.analysis.fake_engine import tracked_step
    from bench.run.ranks import fake_process_group

    steps = []
    for rank in range(ranks):
        with fake_process_group(ranks, rank):
            steps.append(tracked_step(_case(ranks), SPEC, "cpu", ranks=ranks, cuda_autocast=False))
    return tuple(steps)


@pytest.mark.slow  # real ranks and a prediction of each: 35-75 s on 2 busy cores for 2 ranks, 80 s for 4
@pytest.mark.parametrize("ranks", [RANKS, 2 * RANKS])
def test_the_one_process_prediction_equals_the_real_ranks_to_the_byte(ranks):
    """Real gloo ranks: the same loss and gradients as one process on the global batch; and `predict --ranks N`
    equal to them, each rank's live-tensor peak to the byte, and the largest rank's weights, gradients, optimizer
    state and communication too."""
    pytest.importorskip("transformers")
    from bench.analysis.predict import predict_case
    from bench.core.memory_categories import COMMUNICATION

    measured, steps = _measured(ranks), _predicted_steps(ranks)
    assert min(step.peak_bytes for step in steps) == measured["rank_peak_min_bytes"]
    assert max(step.peak_bytes for step in steps) == measured["rank_peak_max_bytes"]
    largest = max(steps, key=lambda step: step.peak_bytes).peak_by_category
    exact_columns = {"params": "peak_params_bytes", "grads": "peak_grads_bytes",
                     "optimizer_state": "peak_optimizer_bytes", COMMUNICATION: "peak_communication_bytes"}
    for category, column in exact_columns.items():
        assert largest.get(category, 0) == measured[column], (category, largest, measured)
    predicted = predict_case(_case(ranks), engine="cpu", ranks=ranks)  # the command's own path
    assert predicted["predicted_bytes"] == measured["rank_peak_max_bytes"], predicted
