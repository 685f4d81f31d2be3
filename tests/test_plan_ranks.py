"""`plan --max-ranks`: the fewest ranks on which some plan fits, each rank count past one trying only candidates with
a sharded member (the others reused from the one-rank search); on a tiny model on the CPU."""

from __future__ import annotations

import dataclasses
import math
import re

import pandas as pd
import pytest

from bench.analysis import plan, plan_cost, plan_ranks, plan_search
from bench.cli.main import main
from bench.measure.op_cost import CONV, MATMUL, CpuSpeed
from strategies import STRATEGIES

WORKLOAD = "gpt_mini:layers=2:width=32:heads=2:seq_len=16:dropout=0.0"  # no BatchNorm, no dropout: sharding matches
FIGURES = plan_cost.cpu_figures(CpuSpeed({(kind, dtype): 1e10 for kind in (MATMUL, CONV)
                                          for dtype in ("float32", "bfloat16")}, 1e10, 1e-6), "test CPU")


def _request(limit_bytes: int) -> plan.PlanRequest:
    return plan.PlanRequest(WORKLOAD, "synthetic", 4, "cpu", "test CPU", limit_bytes, 0, plan_cost.to_json(FIGURES),
                            max_candidates=8, max_search_s=600)


def _sharded(spec: str) -> bool:
    return any(STRATEGIES.get(member.split(":")[0]).distributed for member in spec.split("+"))


@pytest.fixture(scope="module")
def one_rank() -> plan_search.Searched:
    searched = plan_search.search(_request(2**40))
    plan.decide(searched.rows, allow_different=False)
    return searched


def test_a_limit_one_gpu_meets_is_answered_on_one_rank_without_sharding(one_rank):
    counts = plan_ranks.fewest_ranks(_request(2**40), max_ranks=4)
    assert [c.ranks for c in counts] == [1]
    assert counts[0].answer is not None and not _sharded(counts[0].answer["strategy"])


def test_the_fewest_ranks_whose_sharded_plan_fits_where_one_gpu_cannot(one_rank):
    baseline = next(r for r in one_rank.rows if r["strategy"] == "baseline")
    # no technique on one GPU saves 40% here (the model's states are most of its step); sharded over ranks they do
    limit = int(baseline["judged_bytes"] * 0.6)
    counts = plan_ranks.fewest_ranks(_request(limit), max_ranks=4)
    assert counts[0].ranks == 1 and counts[0].answer is None
    last = counts[-1]
    assert last.ranks >= 2 and last.answer is not None, [c.smallest for c in counts]
    assert _sharded(last.answer["strategy"]) and last.answer["judged_bytes"] <= limit
    assert last.answer["est_step_time_ms"] is not None
    assert "its compute plus its collectives" in last.answer["message"]
    for count in counts[1:]:  # past one rank: only sharded candidates ran, each at its rank count
        assert count.searched.rows and all(_sharded(r["strategy"]) and r["ranks"] == count.ranks
                                           for r in count.searched.rows)
        assert all(r["strategy"] != "baseline" for r in count.searched.rows)  # reused, not run again


def test_no_more_ranks_than_a_global_batch_has_samples_and_any_with_a_batch_per_rank():
    assert plan_ranks.rank_counts(8, dataclasses.replace(_request(1), batch_size=3)) == [1, 2, 3]
    assert plan_ranks.rank_counts(2, dataclasses.replace(_request(1), batch_size=64)) == [1, 2]
    assert plan_ranks.rank_counts(8, dataclasses.replace(_request(1), batch_size=1, batch_per_rank=1)) == [*range(1, 9)]


def test_a_batch_per_rank_grows_the_steps_batch_with_the_ranks(monkeypatch):
    """`plan --max-ranks 8 --batch-size 2`: each count's search plans the step of 2 samples a rank."""
    seen = {}

    def search(request, progress, executor=None, address=None):
        seen[request.ranks] = request.batch_size
        return _searched_with(request, {"fsdp": 2000 // request.ranks}), ""

    monkeypatch.setattr(plan_search, "search_where_cuda_runs", search)
    request = dataclasses.replace(_request(300), batch_size=2, batch_per_rank=2)
    counts = plan_ranks.fewest_ranks(request, max_ranks=8)
    assert plan_ranks.fewest(counts).ranks == 7 and seen == {n: 2 * n for n in (1, 2, 4, 8, 5, 6, 7)}
    assert all(row["batch_size"] == 2 * count.ranks for count in counts for row in count.searched.rows)
    assert request.on_ranks(7).batch_size == 14 and dataclasses.replace(request, batch_per_rank=0).on_ranks(7) \
        .batch_size == 2


@pytest.mark.parametrize("argv, named", [
    (["--ranks", "2", "--max-ranks", "4"], "--ranks 2"),
    (["--max-ranks", "4", "--confirm"], "--confirm"),
    (["--max-ranks", "1000000"], "--ranks 1,000,000"),
    (["--strategies", "checkpoint,nope"], "'nope'"),
    (["--strategies", "pitfall_loss_sum"], "never tries it"),
])
def test_bad_max_ranks_is_one_line_and_exit_2(argv, named, capsys):
    code = main(["plan", "--workload", WORKLOAD, "--budget", "1MiB", "--device", "cpu", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and named in err, err


def test_strategies_restrict_the_candidates_to_their_settings_and_combinations():
    request = dataclasses.replace(_request(2**40), ranks=2, strategies=["fsdp", "checkpoint"], max_candidates=6)
    rows = plan_search.search(request).rows
    ran = {r["strategy"] for r in rows}
    assert "fsdp" in ran and any(spec.startswith("checkpoint") for spec in ran)
    members = {m.split(":")[0] for spec in ran for m in spec.split("+")}
    assert members <= {"baseline", "fsdp", "checkpoint"}, members


def test_the_cli_writes_the_csv_after_each_rank_count(tmp_path, capsys):
    code = main(["plan", "--workload", WORKLOAD, "--batch-size", "4", "--budget", "1GiB", "--device", "cpu",
                 "--max-ranks", "2", "--max-candidates", "3", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "plan on 1 rank: 3 candidates, answer" in captured.err
    assert "answer: 1 GPU, with" in captured.out
    (csv,) = tmp_path.glob("plan-*.csv")
    assert str(csv) in captured.err


def _searched_with(request: plan.PlanRequest, judged: dict[str, int]) -> plan_search.Searched:
    rows = []
    for spec, value in judged.items():
        row = plan.empty_row(request, spec, spec.count("+") + 1)
        row.update(judged_bytes=value, est_step_time_ms=10.0, fits=value <= request.limit_bytes,
                   differs_by_design=None)
        rows.append(row)
    return plan_search.Searched(rows)


@pytest.mark.parametrize("answer_at, top", [(1, 8), (2, 8), (3, 8), (5, 8), (8, 8), (7, 7), (None, 8), (6, 64)])
def test_rank_counts_are_searched_by_doubling_then_halving_and_find_the_fewest(answer_at, top, monkeypatch):
    """Synthetic per-GPU peaks that fall with the ranks: the search lands on the fewest ranks that fit, as the
    walk 1, 2, 3, ... would, in about log2 of the counts; every count below the answer it tried had none."""
    limit = 1000
    searched_ranks = []

    def search(request, progress, executor=None, address=None):
        searched_ranks.append(request.ranks)
        fits = answer_at is not None and request.ranks >= answer_at
        return _searched_with(request, {"fsdp": limit - 1 if fits else limit + 100 // request.ranks}), ""

    monkeypatch.setattr(plan_search, "search_where_cuda_runs", search)
    request = dataclasses.replace(_request(limit), batch_size=top)
    lines = []
    counts = plan_ranks.fewest_ranks(request, max_ranks=top, progress=lines.append)
    best = plan_ranks.fewest(counts)
    assert (best.ranks if best else None) == answer_at
    # each count's line bounds the counts left, this one included, and the bound holds
    bounds = [int(re.search(r"at most (\d+) rank counts left", line)[1]) for line in lines
              if line.startswith("plan on ")]
    assert len(bounds) == len(searched_ranks) and bounds[-1] >= 1
    assert all(bound >= len(searched_ranks) - index for index, bound in enumerate(bounds))
    assert [c.ranks for c in counts] == sorted(searched_ranks) and len(set(searched_ranks)) == len(searched_ranks)
    assert all(c.answer is None for c in counts if answer_at is None or c.ranks < answer_at)
    assert len(searched_ranks) <= 2 * math.ceil(math.log2(top)) + plan_ranks.SCANNED_GAP
    if answer_at is None:
        assert searched_ranks[-1] == top
    assert plan_ranks.monotonic_check(counts).startswith("held")
    walked = plan_ranks.skipped(counts, top, request)
    assert set(walked) | set(searched_ranks) >= set(range(1, (answer_at or top) + 1))


def test_the_last_gap_is_scanned_since_reserved_memory_can_grow_with_the_ranks(monkeypatch):
    """The shape llama-3.1-70b gave (global batch 8, checkpoint:segments=all+fsdp:offload=cpu, judged per H100 as
    reserved + the CUDA context): 5 ranks 79.5 GiB, 6 ranks 87.3, 7 ranks 87.1, 8 ranks 62.8; under an 80 GiB limit
    the fewest is 5, which halving from 8 through 6 and 7 would never try."""
    gib = 2**30
    judged = {1: 5000 * gib, 2: 3000 * gib, 4: 110 * gib, 5: int(79.5 * gib), 6: int(87.3 * gib),
              7: int(87.1 * gib), 8: int(62.8 * gib)}
    searched_ranks = []

    def search(request, progress, executor=None, address=None):
        searched_ranks.append(request.ranks)
        return _searched_with(request, {"checkpoint+fsdp": judged.get(request.ranks, 200 * gib)}), ""

    monkeypatch.setattr(plan_search, "search_where_cuda_runs", search)
    counts = plan_ranks.fewest_ranks(dataclasses.replace(_request(80 * gib), batch_size=8), max_ranks=8)
    assert plan_ranks.fewest(counts).ranks == 5
    assert searched_ranks == [1, 2, 4, 8, 5]
    assert plan_ranks.skipped(counts, 8, dataclasses.replace(_request(1), batch_size=8)) == [3]
    assert plan_ranks.monotonic_check(counts).startswith("held")  # 1, 2, 4, 5, 8: falling over the counts tried
    counts = plan_ranks.fewest_ranks(dataclasses.replace(_request(76 * gib), batch_size=8), max_ranks=8)
    assert plan_ranks.fewest(counts).ranks == 8 and searched_ranks[-3:] == [5, 6, 7]
    assert "checkpoint+fsdp 5 -> 6 ranks grew by" in plan_ranks.monotonic_check(counts)


def test_a_peak_that_grows_with_the_ranks_is_named(monkeypatch):
    values = {1: 900, 2: 1200, 4: 1100}  # 2 -> 4 ranks falls, 1 -> 2 grows: the check names the growth

    def search(request, progress, executor=None, address=None):
        return _searched_with(request, {"fsdp": values.get(request.ranks, 2000)}), ""

    monkeypatch.setattr(plan_search, "search_where_cuda_runs", search)
    counts = plan_ranks.fewest_ranks(dataclasses.replace(_request(800), batch_size=4), max_ranks=4)
    check = plan_ranks.monotonic_check(counts)
    assert check.startswith("VIOLATED: ") and "fsdp 1 -> 2 ranks grew by 300 B" in check


def test_max_ranks_beyond_what_plan_searches_is_one_line_naming_the_range():
    """`--max-ranks 10000` searched rank counts for hours (a ZeRO-1 prediction traces each rank): refused at once."""
    from cli_helpers import cli, one_line_exit_2

    done = cli("plan", "--device", "cpu", "--budget", "1KiB", "--max-ranks", "10000", "--workload",
               "deep_mlp:layers=4:width=8", "--batch-size", "2", "--out", "/nonexistent/never-made", timeout=120)
    one_line_exit_2(done, "--max-ranks 10,000", "1 to 1,024")


def test_the_cli_rewrites_its_own_csv_after_the_second_rank_count(tmp_path, capsys):
    """A search past one rank rewrites the file it made after the first count (it was refused as another run's
    file: `plan --max-ranks 8` for llama-3.1-70b ended with "exists already" after minutes of work)."""
    code = main(["plan", "--workload", WORKLOAD, "--batch-size", "4", "--budget", "1KiB", "--device", "cpu",
                 "--max-ranks", "2", "--max-candidates", "2", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert "exists already" not in captured.err
    assert "plan on 2 ranks:" in captured.err, captured.err
    (csv,) = tmp_path.glob("plan-*.csv")
    assert set(pd.read_csv(csv)["ranks"]) == {1, 2}
    assert code == 1  # nothing fits in 1 KiB


def test_a_checkpoint_budget_with_a_sharded_strategy_is_refused_with_why():
    """The budget's plan predicts the composed step in one process, where fsdp cannot build its mesh: on several
    ranks the combination is an unsupported row saying what to give instead, not an error of the mesh."""
    from bench.analysis.plan_candidates import compose, Setting
    from bench.core.errors import Unsupported
    from strategies import StepContext, StrategySpec
    from workloads import get_workload

    composite = StrategySpec("checkpoint:budget=100MiB+fsdp").build()
    composite.bind(StepContext("train", "cuda", get_workload("hf:tiny-llama:seq_len=16"), 4, ranks=2))
    with pytest.raises(Unsupported, match="give checkpoint:segments"):
        composite.check(composite.context)
    context = StepContext("train", "cuda", get_workload("hf:tiny-llama:seq_len=16"), 4, ranks=2)
    assert compose((Setting("checkpoint:budget=100MiB", "checkpoint"), Setting("fsdp", "fsdp")), context) is None
    assert compose((Setting("checkpoint:segments=all", "checkpoint"), Setting("fsdp", "fsdp")), context) is not None
