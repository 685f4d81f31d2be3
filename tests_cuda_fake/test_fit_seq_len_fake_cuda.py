"""`fit --over seq_len --device cuda` on fake CUDA: each probe is `predict`'s row on CUDA's operators, judged as
`plan` judges (max_memory_reserved + the CUDA context against the budget), and --gpu gives the budget and the
capability. Not asserted: that a GPU agrees (tests/test_cuda_prediction.py checks predict on a real one)."""

from __future__ import annotations

import pytest

from bench.analysis import fit_seq_len, predict
from bench.cli.main import main
from bench.core.gpus import CUDA_CONTEXT_BYTES, find_gpu
from bench.run.case import Case

pytest.importorskip("transformers")

TINY = "hf:tiny-llama"  # 128 positions


def reserved_plus_context(seq_len: int, capability) -> int:
    (row,) = predict.predict_cases([Case(fit_seq_len.seq_len_spec(TINY, seq_len), "baseline", "train", 1, "cuda",
                                         data="synthetic")], capability=capability)
    assert row["engine"] == "fake-cuda"
    return row["predicted_reserved_bytes"] + CUDA_CONTEXT_BYTES


def test_the_longest_sequence_on_cuda_is_judged_by_reserved_memory_and_the_context():
    capability = find_gpu("RTX 4090").capability
    at_most = reserved_plus_context(128, capability)
    budget = at_most - 1  # 128 tokens do not fit by one byte
    result = fit_seq_len.fit_seq_len("baseline", budget, "train", "cuda", TINY, "synthetic", 1, step=32,
                                     capability=capability)
    assert result.seq_len < 128 and result.seq_len % 32 == 0
    if result.seq_len:
        assert result.judged_bytes == reserved_plus_context(result.seq_len, capability) <= budget
    assert result.next_judged_bytes == reserved_plus_context(result.seq_len + 32, capability) > budget
    assert "reserved + 500 MiB CUDA context" in result.note and result.monotonic_check.startswith("non-decreasing")


def test_fit_with_a_gpu_takes_its_memory_as_the_budget(tmp_path, capsys):
    assert main(["fit", "--workload", TINY, "--gpu", "RTX 4090", "--over", "seq_len", "--seq-step", "64",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "RTX 4090 (24.0 GiB)" in out and "capped by the longest sequence, 128" in out
