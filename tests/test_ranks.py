"""Sharded training on 2 CPU ranks (gloo): ddp, zero1 and fsdp verified against one process on the global batch,
their per-rank peaks ordered as sharding says, the collectives' buffers filed as communication, and predict's
one-process fake-process-group estimate equal to the measurement, rank by rank, to the byte."""

from __future__ import annotations

import functools

import pytest

from bench.analysis.fake_engine import tracked_step
from bench.analysis.predict import predict_case
from bench.core.memory_categories import COMMUNICATION
from bench.run.isolation import RunOptions
from bench.core.results import new_row
from bench.run.ranks import fake_process_group, merge_rank_rows
from bench.run.result import CaseResult
from bench.run.case import Case
from bench.run.runner import run_case

WORKLOAD = "gpt_mini:layers=2:width=32:heads=2:seq_len=16:dropout=0.0"  # no BatchNorm: sharding must match
# equal layers: ZeRO's greedy partition of the parameters gives each rank exactly half of them
UNIFORM = "deep_mlp:layers=24:width=8"
RANKS = RunOptions(threads=1, ranks=2)
# ddp and zero1 are matched and predicted on UNIFORM, the runs the ordering test needs anyway (two 2-rank runs fewer)
CHECKED_ON = {"ddp": UNIFORM, "zero1": UNIFORM}


def _case(strategy: str, workload: str = WORKLOAD, batch: int = 4) -> Case:
    return Case(workload, strategy, "train", batch, "cpu", data="synthetic", warmup=0, steps=1)


@functools.lru_cache(maxsize=None)
def _row(strategy: str, workload: str = WORKLOAD) -> dict:
    return run_case(_case(strategy, workload), env={}, options=RANKS)


MIXED = "fsdp:param_dtype=bfloat16:reduce_dtype=float32"  # FSDP2's mixed precision as it is usually configured


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp", "fsdp+checkpoint", "fsdp+amp", MIXED])
def test_sharded_step_matches_one_process_on_the_global_batch(strategy):
    row = _row(strategy, CHECKED_ON.get(strategy, WORKLOAD))
    assert row["status"] == "ok", row["message"]
    assert row["ranks"] == 2 and row["matches_baseline"] is True, row
    assert row["rank_peak_min_bytes"] <= row["rank_peak_max_bytes"] == row["peak_mem_bytes"]


def test_fsdp_holds_less_per_rank_than_ddp_and_zero1_halves_the_optimizer_state():
    ddp, zero1, fsdp = _row("ddp", UNIFORM), _row("zero1", UNIFORM), _row("fsdp", UNIFORM)
    assert fsdp["rank_peak_max_bytes"] < zero1["rank_peak_max_bytes"] < ddp["rank_peak_max_bytes"]
    assert 0.45 <= zero1["peak_optimizer_bytes"] / ddp["peak_optimizer_bytes"] <= 0.55
    assert fsdp["peak_params_bytes"] < 0.6 * ddp["peak_params_bytes"]


def test_a_batchnorm_model_does_not_match_and_says_where():
    row = _row("ddp", "unet:depth=2:base_channels=4:image_size=32x16")
    assert row["status"] == "ok" and row["matches_baseline"] is False and row["bn_stats_match"] is False, row


def test_sharding_needs_ranks():
    row = run_case(_case("fsdp"), env={}, options=RunOptions(threads=1))
    assert row["status"] == "unsupported" and "--ranks 2" in row["message"]


def _predicted_ranks(strategy: str, workload: str) -> list:
    """Each rank's tracked step, in this one process as that rank of PyTorch's fake process group, on the CPU engine
    (what `predict --ranks 2` runs; it reports the largest)."""
    steps = []
    for rank in range(RANKS.ranks):
        with fake_process_group(RANKS.ranks, rank):
            steps.append(tracked_step(_case(strategy, workload), strategy, "cpu", ranks=RANKS.ranks,
                                      cuda_autocast=False))
    return steps


# the tracker's categories -> the measured breakdown's columns where they correspond one to one; the rest (forward,
# logits, backward and optimizer temporaries, batch) is compared as one sum, since predict files the logits apart
EXACT_COLUMNS = {"params": "peak_params_bytes", "grads": "peak_grads_bytes",
                 "optimizer_state": "peak_optimizer_bytes", COMMUNICATION: "peak_communication_bytes"}
TO_THE_BYTE = ["ddp", "zero1", "fsdp", "fsdp+checkpoint", "fsdp+amp",
               MIXED,  # peaks at a reduce-scatter: gloo's copy of its input (strategies/fsdp.py) is in the peak
               pytest.param("fsdp:replicate=2", marks=pytest.mark.slow),  # 2 replica groups of 1: HSDP's all-reduce
               pytest.param("fsdp:reshard_after_forward=false", marks=pytest.mark.slow),
               pytest.param(f"{MIXED}+checkpoint", marks=pytest.mark.slow),
               # accelerate's FSDP2 policy for mixed_precision="bf16": gradients reduced and outputs cast in bfloat16
               pytest.param("fsdp:param_dtype=bfloat16:reduce_dtype=bfloat16:output_dtype=bfloat16",
                            marks=pytest.mark.slow)]


@pytest.mark.parametrize("strategy", TO_THE_BYTE)
def test_the_one_process_prediction_equals_the_real_ranks_to_the_byte(strategy):
    """`predict --ranks 2` (one process, PyTorch's fake process group, CPU engine) against 2 real gloo processes
    (`compare --ranks 2 --device cpu`): each rank's peak equal to the byte, and the largest rank's breakdown too."""
    workload = CHECKED_ON.get(strategy, WORKLOAD)
    measured = _row(strategy, workload)
    assert measured["status"] == "ok", measured["message"]
    steps = _predicted_ranks(strategy, workload)
    assert sorted(step.peak_bytes for step in steps) == [measured["rank_peak_min_bytes"],
                                                         measured["rank_peak_max_bytes"]]
    largest = max(steps, key=lambda step: step.peak_bytes).peak_by_category
    for category, column in EXACT_COLUMNS.items():
        assert largest.get(category, 0) == measured[column], (category, largest, measured)
    if "reshard_after_forward" not in strategy:  # kept unsharded from forward to backward, it peaks before any
        assert largest.get(COMMUNICATION, 0) > 0, f"{strategy}: no collective's buffer at the peak"  # reduce-scatter
    predicted = predict_case(_case(strategy, workload), engine="cpu", ranks=2)  # the command's own path
    assert predicted["predicted_bytes"] == measured["rank_peak_max_bytes"], predicted
    assert predicted["predicted_communication_bytes"] == measured["peak_communication_bytes"], predicted


@pytest.mark.slow  # among the longest of make test: CI runs it in its step of long tests (.ci/run)
def test_mixed_precision_changes_the_numerics_and_matches_within_16_bit_tolerances():
    """bfloat16 compute differs from the float32 baseline by more than the exact tolerance allows (so the row would
    say `False` under it), and by less than amp's 16-bit tolerance, which the row is verified with."""
    from strategies.amp import Amp
    from strategies import EXACT

    row = _row(MIXED)
    assert row["matches_baseline"] is True, row["message"]
    assert EXACT.grad_rtol < row["max_grad_rel_diff"] <= Amp.tolerance.grad_rtol, row["max_grad_rel_diff"]
    assert _row("fsdp")["max_grad_rel_diff"] <= EXACT.grad_rtol  # plain FSDP2: float summation order only


@pytest.mark.slow
def test_mixed_precision_composes_with_compile_on_real_ranks_and_in_the_prediction():
    """Through torch.compile the 2 gloo ranks train and match the baseline, and predict traces each rank from
    inductor's generated code; not to the byte: the measurement counts the allocator's events, the prediction
    inductor's buffers (docs/sharding.md gives both figures)."""
    spec = f"{MIXED}+compile"
    row = _row(spec)
    if row["status"] == "unsupported" and "compiler" in row["message"]:
        pytest.skip(row["message"])
    assert row["status"] == "ok" and row["matches_baseline"] is True, row["message"]
    predicted = predict_case(_case(spec), engine="cpu", ranks=2)
    assert predicted["status"] == "ok" and predicted["predicted_bytes"] > 0, predicted["message"]


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
@pytest.mark.parametrize("workload", ["gpt_mini:layers=2:width=64:heads=2:seq_len=64", "hf:tiny-llama:seq_len=32"])
def test_ddp_on_fake_tensors_counts_what_its_real_steps_do_to_the_byte(strategy, workload):
    """DistributedDataParallel on fake tensors (what `predict --device cuda --ranks N` runs at full size): its C++
    cross-rank check skipped and its bucket rebuild emulated (strategies/framework/sharding.py), each rank's peak and
    breakdown equal to the same rank's step on real CPU tensors, whose reducer rebuilds its buckets for real."""
    case = Case(workload, strategy, "train", 4, "cpu", data="synthetic")
    for rank in range(RANKS.ranks):
        with fake_process_group(RANKS.ranks, rank):
            real = tracked_step(case, strategy, "cpu", ranks=RANKS.ranks, cuda_autocast=False)
            fake = tracked_step(case, strategy, "fake", ranks=RANKS.ranks, cuda_autocast=False)
        assert fake.peak_bytes == real.peak_bytes, (rank, fake.peak_by_category, real.peak_by_category)
        assert fake.peak_by_category == real.peak_by_category and real.peak_by_category[COMMUNICATION] > 0


def test_the_collectives_buffers_are_filed_as_communication():
    """DDP's gradient buckets (rebuilt in its second forward) mirror every gradient: communication equals the
    weights, and none of it is counted as activations any more. FSDP2's unsharded unit in flight is weights, above
    the 1/2 that is this rank's shard, and the reduce-scatter's buffers are communication."""
    ddp, fsdp = _row("ddp", UNIFORM), _row("fsdp", UNIFORM)
    assert ddp["peak_communication_bytes"] == ddp["peak_params_bytes"] > 0
    assert ddp["peak_activations_bytes"] < ddp["peak_communication_bytes"]  # 2 samples of width 8, per layer
    assert 0.5 * ddp["peak_params_bytes"] < fsdp["peak_params_bytes"] < 0.6 * ddp["peak_params_bytes"]
    assert fsdp["peak_communication_bytes"] > 0


def test_merged_row_takes_the_largest_rank_and_its_breakdown():
    rows = [{"status": "ok", "peak_mem_bytes": 100, "peak_params_bytes": 60, "step_time_ms_median": 5.0},
            {"status": "ok", "peak_mem_bytes": 120, "peak_params_bytes": 70, "step_time_ms_median": 6.0}]
    merged = merge_rank_rows([CaseResult(new_row(r)) for r in rows]).row
    assert merged["peak_mem_bytes"] == 120 and merged["peak_params_bytes"] == 70 and merged["ranks"] == 2
    assert merged["rank_peak_min_bytes"] == 100 and merged["step_time_ms_median"] == 5.0  # rank 0's time
    failed = merge_rank_rows([CaseResult(new_row(rows[0])), CaseResult.failed("boom")]).row
    assert failed["status"] == "error" and failed["message"] == "boom"


@pytest.mark.slow  # in .ci/run's "slow: ranks" step
def test_a_port_taken_before_rank_0_listens_is_retried_on_another(monkeypatch):
    """The port found free is taken by another process before rank 0's store listens on it (a second run, a test
    session's other worker): the ranks start again on a fresh port and the case is measured."""
    import socket

    from bench.run import ranks

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        offered = [taken.getsockname()[1]]
        fresh = ranks._free_port
        monkeypatch.setattr(ranks, "_free_port", lambda: offered.pop() if offered else fresh())
        row = run_case(_case("ddp", "deep_mlp:layers=2:width=4", batch=2), env={}, options=RANKS)
    assert not offered  # the taken port was tried first
    assert row["status"] == "ok" and row["ranks"] == 2 and row["matches_baseline"] is True, row
