"""`plan --max-ranks`: the fewest ranks on which some plan fits, each rank count past one trying only candidates with
a sharded member (the others reused from the one-rank search); on a tiny model on the CPU."""

from __future__ import annotations

import dataclasses

import pytest

from bench.analysis import plan, plan_cost, plan_ranks, plan_search
from bench.cli.main import main
from bench.core.results import Status
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
    assert "communication not modelled" in last.answer["message"]
    for count in counts[1:]:  # past one rank: only sharded candidates ran, each at its rank count
        assert count.searched.rows and all(_sharded(r["strategy"]) and r["ranks"] == count.ranks
                                           for r in count.searched.rows)
        assert all(r["strategy"] != "baseline" for r in count.searched.rows)  # reused, not run again


def test_no_more_ranks_than_the_global_batch_has_samples():
    assert plan_ranks.rank_counts(8, 3) == [1, 2, 3]
    assert plan_ranks.rank_counts(2, 64) == [1, 2]


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
