"""The per-rank prediction traces one rank of each `rank_signature`: the same largest peak and breakdown, to the byte,
as tracing every rank, on models whose shards and batch shares are even (one rank traced) and uneven."""

from dataclasses import replace

import pytest

from bench.analysis.fake_engine import tracked_step
from bench.analysis.predict import predict_case
from bench.run.case import Case

EVEN = "gpt_mini:layers=2:width=32:heads=2:seq_len=16:dropout=0.0"
# 3 ranks: width 20 and the vocabulary's rows split 7/7/6 and the like, a batch of 4 as 2/1/1
UNEVEN = "gpt_mini:layers=2:width=20:heads=2:seq_len=16:dropout=0.0"


def _case(workload: str, strategy: str, batch_size: int) -> Case:
    return Case(workload=workload, strategy=strategy, phase="train", batch_size=batch_size, device="cpu")


def _both(workload: str, strategy: str, batch_size: int, ranks: int):
    case = _case(workload, strategy, batch_size)
    shortcut = tracked_step(case, strategy, "cpu", ranks=ranks)
    every = tracked_step(case, strategy, "cpu", ranks=ranks, every_rank=True)
    return shortcut, every


@pytest.mark.parametrize("strategy, workload, batch_size, ranks, traced", [
    ("fsdp", EVEN, 4, 2, (0,)),                     # every chunk and share the same size: one rank
    ("fsdp", UNEVEN, 4, 3, (0, 1, 2)),              # shares 2/1/1 and chunks of 7/7/6 rows: all differ
    ("fsdp+checkpoint", UNEVEN, 6, 3, (0, 2)),      # shares 2/2/2; width 20 splits 7/7/6: the last rank differs
    ("fsdp:replicate=2", UNEVEN, 6, 6, (0, 2)),     # HSDP, 2 groups of 3 shards: 7/7/6 rows by place in a group
    ("ddp", EVEN, 5, 2, (0, 1)),                    # shares 3/2
    ("ddp", EVEN, 4, 2, (0,)),
    ("zero1", EVEN, 4, 2, (0, 1)),                  # whole parameters partitioned by size: no signature
])
def test_one_rank_of_each_signature_gives_every_ranks_largest_peak(strategy, workload, batch_size, ranks, traced):
    shortcut, every = _both(workload, strategy, batch_size, ranks)
    assert every.ranks_traced == tuple(range(ranks))
    assert shortcut.ranks_traced == traced
    assert shortcut.peak_bytes == every.peak_bytes
    assert shortcut.peak_by_category == every.peak_by_category


def test_fsdp_signatures_name_the_rows_each_rank_holds():
    case = _case(UNEVEN, "fsdp", 4)
    step = tracked_step(case, "fsdp", "cpu", ranks=3, every_rank=True)
    signatures = step.rank_signatures
    assert [s[1] for s in signatures] == [2, 1, 1]  # the batch's shares
    rows = [s[3] for s in signatures]
    assert rows[0] == rows[1] != rows[2]  # torch.chunk: ceil(rows / 3) to each rank, the rest to the last
    assert all(first >= last for first, last in zip(rows[0], rows[2]))
    assert 7 in rows[0] and 6 in rows[2]  # the width's 20 rows: 7, 7, 6


def test_the_predict_row_says_which_ranks_were_traced():
    row = predict_case(replace(_case(EVEN, "fsdp", 8), device="cpu"), engine="cpu", ranks=4)
    assert row["status"] == "ok", row
    assert "rank 0 traced: the other 3 hold chunks and batch shares of the same sizes" in row["message"]


def test_predict_never_falls_back_to_a_real_step_of_a_model_the_machine_cannot_hold(monkeypatch):
    """DDP's reducer cannot run on fake tensors: its prediction is a real CPU step, refused where the weights,
    gradients and AdamW's state alone exceed the free memory (a full-size model), run where explicitly asked."""
    from bench.measure import resident

    case = _case(EVEN, "ddp", 4)
    monkeypatch.setattr(resident, "available_bytes", lambda: 1000)
    refused = predict_case(case, engine="auto", ranks=2)
    assert refused["status"] == "unsupported", refused
    assert "a real CPU step instead would hold at least" in refused["message"]
    assert "more than the 1000 B this machine has free: not run" in refused["message"]
    asked = predict_case(case, engine="cpu", ranks=2)
    assert asked["status"] == "ok" and asked["predicted_bytes"] > 0, asked
    monkeypatch.setattr(resident, "available_bytes", lambda: 1 << 40)
    assert predict_case(case, engine="auto", ranks=2)["predicted_bytes"] == asked["predicted_bytes"]
