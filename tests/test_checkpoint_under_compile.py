"""Activation checkpointing composed with torch.compile: dynamo traces through each checkpoint, where it takes only a
`context_fn` that is a plain function returning two dispatch modes (a method it calls without its object), so each
checkpointing strategy's step runs compiled, BatchNorm models included, with the eager partition backend (the one
dynamo traces for inductor too, without C++ to build)."""

from __future__ import annotations

import pytest

from bench.run.case import Case
from bench.run.runner import run_case

COMPILED = "compile:backend=aot_eager_decomp_partition"
TINY_GPT = "gpt_mini:layers=2:width=32:heads=2:seq_len=16"


@pytest.mark.slow  # in .ci/run's long tests of make test
@pytest.mark.parametrize("workload, checkpointing", [
    (TINY_GPT, "checkpoint"),
    (TINY_GPT, "selective_checkpoint"),
    (TINY_GPT, "selective_checkpoint:policy=every_other_mm"),
    ("captcha_resnet18:width=8", "checkpoint"),  # BatchNorm: its eager recompute restores the running statistics
])
def test_each_checkpointing_strategy_runs_compiled(workload, checkpointing):
    spec = f"{checkpointing}+{COMPILED}"
    row = run_case(Case(workload, spec, "train", 2, "cpu"))
    assert row["status"] == "ok", row["message"]
    assert row["peak_mem_bytes"] > 0
    if workload.startswith("captcha"):  # no dropout: compiled, it matches the baseline, running statistics too
        assert row["matches_baseline"] is True and row["bn_stats_match"] is True, row
