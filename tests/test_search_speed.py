"""What makes fit's and plan's searches shorter without changing their answers: `fit --over seq_len`
predicts the baseline only when asked for; a search in rounds where nothing fits yet probes the smallest point at
once; the progress lines say how many probes or strategies are left and about how long they take; a CUDA search
without a GPU runs whole in one fake-CUDA process, its rows the predictions of `predict` (slow: the fake-CUDA
environment)."""

from __future__ import annotations

import pytest

from bench.analysis import fit_seq_len, predict
from bench.analysis.fit_search import largest_under
from bench.core.gpus import CUDA_CONTEXT_BYTES
from bench.measure import fake_cuda
from bench.run import eta
from bench.run.case import Case


def test_the_baseline_is_searched_only_when_asked_for_or_alone():
    assert fit_seq_len.searched_specs(["lora", "qlora"]) == ["lora", "qlora"]
    assert fit_seq_len.searched_specs(["lora", "baseline", "lora"]) == ["baseline", "lora"]
    assert fit_seq_len.searched_specs([]) == ["baseline"]


class Rounds:
    def __init__(self):
        self.rounds: list[list[int]] = []

    def __call__(self, points: list[int]) -> None:
        self.rounds.append(list(points))


@pytest.mark.parametrize("jobs", [2, 3, 4])
def test_a_search_in_rounds_where_nothing_fits_ends_in_its_second_round(jobs):
    """Before: the first round (2048 and its doublings), then points spread below 2048, then the smallest, 256:
    three rounds and five probes for a baseline that fits at no length."""
    judged = lambda n: 150 * 2**30 + n  # noqa: E731 - a full-size baseline: over 24 GiB at any length
    rounds = Rounds()
    assert fit_seq_len.longest_under(judged, 24 * 2**30, 256, 131072, 2048, rounds, jobs) == 0
    assert len(rounds.rounds) == 2 and rounds.rounds[1][0] == 256
    rounds = Rounds()
    assert largest_under(lambda b: 10**9 * b, 100, 16, 32, 4096, rounds, jobs) == 0
    assert len(rounds.rounds) == 2 and rounds.rounds[1][0] == 1


def test_the_probes_left_shrink_to_none_once_the_answer_and_the_step_past_it_are_known():
    budget, step, limit = 1000, 256, 131072
    assert fit_seq_len.probes_left({2048: 500}, budget, step, limit) == 8  # doublings to 131072, then two
    assert fit_seq_len.probes_left({2048: 500, 4096: 2000}, budget, step, limit) == 3  # 8 steps: bisection's 3
    assert fit_seq_len.probes_left({2048: 500, 4096: 2000, 3072: 900, 3328: 1100}, budget, step, limit) == 0
    assert fit_seq_len.probes_left({2048: 5000, 256: None}, budget, step, limit) == 0  # nothing fits
    assert fit_seq_len.probes_left({131072: 10}, budget, step, limit) == 0  # the longest fits


def test_the_time_left_is_the_mean_of_those_done_times_those_left():
    assert eta.left_text(3, 2, 100.0) == "about 3 probes left, ~2m30s"
    assert eta.left_text(3, 0, 0.0, "strategies") == "about 3 strategies left"
    assert eta.left_text(0, 4, 10.0) == "no probes left"
    assert eta.left_text(5, 1, 7.0, "candidates", at_most=True) == "at most 5 candidates left, ~35s"


def test_each_probe_line_says_what_is_left():
    lines = []
    fit_seq_len.fit_seq_len("baseline", 10_000 + 7 * 5000, "train", "cpu", "hf:tiny-llama", "synthetic", 1,
                            step=8, judged_at=lambda n: fit_seq_len.Probe(n, 10_000 + 7 * n, 10_000 + 7 * n, "", ""),
                            progress=lines.append)
    assert lines and all("probes made;" in line for line in lines)
    assert lines[-1].endswith("no probes left]")


@pytest.mark.slow  # about a minute on 2 cores: a search of hf:tiny-llama on fake CUDA, then predict there
@pytest.mark.skipif(fake_cuda.unavailable_reason() is not None, reason=str(fake_cuda.unavailable_reason()))
def test_a_cuda_search_in_one_fake_cuda_process_judges_the_predictions_of_predict(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(fake_cuda, "VENV", fake_cuda.ROOT / ".venv-cuda-fake")  # tests/conftest.py hides it

    def judged(lengths: list[int]) -> list[int]:
        rows = predict.predict_cases([Case(fit_seq_len.seq_len_spec("hf:tiny-llama", n), "lora", "train", 1, "cuda",
                                           data="synthetic") for n in lengths], capability=(8, 9))
        assert [r["engine"] for r in rows] == ["fake-cuda"] * len(lengths), rows[0]["message"]
        return [r["predicted_reserved_bytes"] + CUDA_CONTEXT_BYTES for r in rows]

    shortest, longest = judged([8, 128])
    assert shortest < longest
    budget = (shortest + longest) // 2
    (row,) = fit_seq_len.fit_over_seq_len(["lora"], budget, "train", "cuda", "hf:tiny-llama", "synthetic", 1, step=8,
                                          capability=(8, 9))
    assert row.strategy == "lora" and 8 <= row.seq_len < 128  # the baseline was not asked for
    assert judged([row.seq_len, row.seq_len + 8]) == [row.judged_bytes, row.next_judged_bytes]
    assert row.judged_bytes <= budget < row.next_judged_bytes


def test_each_plan_candidates_line_says_how_many_known_candidates_are_left_and_when_the_search_stops():
    from bench.analysis import plan, plan_cost, plan_search
    from bench.measure.op_cost import CONV, MATMUL, CpuSpeed

    figures = plan_cost.cpu_figures(CpuSpeed({(kind, "float32"): 1e10 for kind in (MATMUL, CONV)}, 1e10, 1e-6), "CPU")
    request = plan.PlanRequest("deep_mlp:layers=4:width=16", "synthetic", 8, "cpu", "this CPU", 2**30, 0,
                               plan_cost.to_json(figures), max_candidates=4, max_search_s=600,
                               strategies=["checkpoint", "amp"])
    lines = []
    searched = plan_search.search(request, lines.append)
    assert lines[0].endswith("baseline ...")  # nothing is known before the baseline ran
    assert all("known candidates left" in line and "no new candidate after" in line for line in lines[1:])
    assert len(lines) == searched.tried and len(lines) >= 2
