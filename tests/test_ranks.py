"""Sharded training on 2 CPU ranks (gloo): ddp, zero1 and fsdp verified against one process on the global batch,
their per-rank peaks ordered as sharding says, and predict's fake-process-group estimate against the measurement."""

from __future__ import annotations

import functools

import pytest

from bench.analysis.predict import predict_case
from bench.run.isolation import RunOptions
from bench.core.results import new_row
from bench.run.ranks import merge_rank_rows
from bench.run.result import CaseResult
from bench.run.runner import Case, run_case

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


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp", "fsdp+checkpoint", "fsdp+amp"])
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


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp"])
def test_predict_per_rank_without_starting_ranks_agrees_with_the_measured_rank_peak(strategy):
    workload = CHECKED_ON.get(strategy, WORKLOAD)
    predicted = predict_case(_case(strategy, workload), engine="cpu", ranks=2)
    assert predicted["status"] == "ok" and predicted["ranks"] == 2, predicted
    measured = _row(strategy, workload)["rank_peak_max_bytes"]
    if strategy != "fsdp":  # ddp and zero1 agree to the byte
        assert abs(predicted["predicted_bytes"] - measured) <= 0.05 * measured, (predicted["predicted_bytes"], measured)
        return
    # FSDP2's real gloo all-gathers and reduce-scatters hold buffers the fake group's do not, how many at the peak
    # depending on the threads' timing: measured 689,980 B in most runs, 698,748 B and 712,828 B in others, against
    # 670,076 B predicted. The prediction is below the measured peak, by up to 10%.
    assert 0 <= measured - predicted["predicted_bytes"] <= 0.10 * measured, (predicted["predicted_bytes"], measured)


def test_merged_row_takes_the_largest_rank_and_its_breakdown():
    rows = [{"status": "ok", "peak_mem_bytes": 100, "peak_params_bytes": 60, "step_time_ms_median": 5.0},
            {"status": "ok", "peak_mem_bytes": 120, "peak_params_bytes": 70, "step_time_ms_median": 6.0}]
    merged = merge_rank_rows([CaseResult(new_row(r)) for r in rows]).row
    assert merged["peak_mem_bytes"] == 120 and merged["peak_params_bytes"] == 70 and merged["ranks"] == 2
    assert merged["rank_peak_min_bytes"] == 100 and merged["step_time_ms_median"] == 5.0  # rank 0's time
    failed = merge_rank_rows([CaseResult(new_row(rows[0])), CaseResult.failed("boom")]).row
    assert failed["status"] == "error" and failed["message"] == "boom"


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
