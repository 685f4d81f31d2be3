"""`fit --over seq_len` (bench.analysis.fit_seq_len): the longest sequence under a budget, on predictions.

Asserted: the answer fits and one step longer does not, by the same predictions (`predict`, fake engine on the
CPU); the search's assumption (the peak never falls as the sequence grows) is checked on its probes and a fall is
reported in the row; bad --over/--gpu values are one line and exit 2; the batch search keeps `over` = batch.
"""

from __future__ import annotations

import pandas as pd
import pytest

from bench.analysis import fit_seq_len, predict
from bench.analysis.fit_seq_len import Probe
from bench.cli.main import main
from bench.core.results import FIT
from bench.run.case import Case

pytest.importorskip("transformers")

TINY = "hf:tiny-llama"  # 128 positions
BUDGET = 1_700_000  # between the predicted peaks at 8 and at 128 tokens of hf:tiny-llama (about 1.1 and 2.2 MiB)


def linear(base: int, per_token: int):
    return lambda seq_len: Probe(seq_len, base + per_token * seq_len, base + per_token * seq_len, "", "")


def test_the_search_lands_on_the_boundary_of_a_linear_peak():
    probes = []

    def judged(seq_len):
        probes.append(seq_len)
        return 10_000 + 7 * seq_len

    budget = 10_000 + 7 * 5000  # 5000 tokens fit, so 4864 (19 x 256) is the longest multiple of 256
    assert fit_seq_len.longest_under(judged, budget, 256, 131072) == 4864
    assert 4864 + 256 in probes  # the step beyond the answer was predicted, over the budget
    assert len(probes) == len(set(probes)) <= 6  # a bracket by doubling from 2048, then two interpolations
    probes.clear()
    assert fit_seq_len.longest_under(lambda n: probes.append(n) or n * n, 3000**2, 256, 131072) == 2816
    assert len(probes) <= 8  # a curved peak: the bisection safeguard keeps it short
    assert fit_seq_len.longest_under(judged, 9_000, 256, 131072) == 0  # not even one step


def test_a_peak_that_falls_as_the_sequence_grows_is_reported():
    def dips(seq_len):  # a drop at 1024 tokens: the search's assumption does not hold
        value = 10_000 * seq_len - (6_000_000 if seq_len >= 1024 else 0)
        return Probe(seq_len, value, value, "", "")

    result = fit_seq_len.fit_seq_len("baseline", 30_000_000, "train", "cpu", TINY, "synthetic", 1, step=256,
                                     max_seq=8192, start=512, judged_at=dips)
    assert result.monotonic_check.startswith("VIOLATED: ") and "fell by" in result.monotonic_check
    fine = fit_seq_len.fit_seq_len("baseline", 30_000_000, "train", "cpu", TINY, "synthetic", 1, step=256,
                                   max_seq=8192, judged_at=linear(0, 10_000))
    assert fine.monotonic_check.startswith("non-decreasing over ")
    assert fine.seq_len == 2816 and fine.judged_bytes <= 30_000_000 < fine.next_judged_bytes


def test_the_longest_sequence_fits_and_one_step_more_does_not_by_the_same_predictions(tmp_path, capsys):
    assert main(["fit", "--workload", TINY, "--budget", str(BUDGET), "--over", "seq_len", "--seq-step", "8",
                 "--out", str(tmp_path)]) == 0
    assert "longest sequence" in capsys.readouterr().out
    frame = pd.read_csv(next(tmp_path.glob("fit-*.csv")))
    assert list(frame.columns) == FIT.names and list(frame["strategy"]) == ["baseline"]
    row = frame.loc[0]
    assert row["over"] == "seq_len" and row["seq_len_step"] == 8 and row["batch_size"] == 1
    assert 8 <= row["seq_len"] < 128 and row["seq_len"] % 8 == 0
    assert row["judged_bytes"] <= BUDGET < row["next_judged_bytes"]
    assert row["monotonic_check"].startswith("non-decreasing") and isinstance(row["peak_by"], str)
    again = predict.predict_cases([Case(fit_seq_len.seq_len_spec(TINY, n), "baseline", "train", 1, "cpu",
                                        data="synthetic") for n in (row["seq_len"], row["seq_len"] + 8)])
    assert [r["predicted_bytes"] for r in again] == [row["judged_bytes"], row["next_judged_bytes"]]


def test_the_batch_search_says_it_searched_the_batch():
    from bench.analysis import fit as fitting

    result = fitting.fit_cpu("baseline", 2**10, "train", "deep_mlp:layers=4:width=16", "synthetic", 64)
    assert result.over == "batch" and result.seq_len is None and result.monotonic_check == ""


@pytest.mark.parametrize("argv, words", [
    (["fit", "--gpu", "RTX 9999", "--over", "seq_len"], ["RTX 9999", "RTX 4090", "H100 80GB"]),
    (["predict", "--gpu", "RTX 9999"], ["RTX 9999", "RTX 4090"]),
    (["fit", "--budget", "1GiB", "--over", "tokens"], ["tokens", "batch", "seq_len"]),
    (["fit", "--gpu", "RTX 4090", "--device", "cpu"], ["--gpu", "cpu"]),
    (["fit"], ["--budget", "--gpu"]),
    (["fit", "--budget", "1GiB", "--over", "seq_len", "--workload", "deep_mlp"], ["seq_len", "deep_mlp"]),
])
def test_bad_fit_and_predict_options_are_one_line_and_exit_2(argv, words, capsys, tmp_path):
    assert main(argv + ["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert all(word in err for word in words), err
