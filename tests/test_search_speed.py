"""What makes fit's and plan's searches shorter without changing their answers: `fit --over seq_len` and
`predict` predict the baseline only when asked for (or when no strategy is named), and a searched baseline starts at
the shortest length, alone; a search in rounds where nothing fits yet probes the smallest point at once; its guesses
of where the peak crosses the budget come from a line or a parabola through the probes nearest it; the progress lines say how many probes or strategies are left and about how long they take; a CUDA search
without a GPU runs whole in one fake-CUDA process, its rows the predictions of `predict` (slow: the fake-CUDA
environment)."""

from __future__ import annotations

import pytest

from bench.analysis import fit_seq_len, predict
from bench.analysis.fit_search import largest_in_rounds, largest_under, polynomial_guess
from bench.cli.main import main
from bench.core.gpus import CUDA_CONTEXT_BYTES
from bench.measure import fake_cuda
from bench.run import eta
from bench.run.case import Case


def test_the_baseline_is_searched_only_when_asked_for_or_alone():
    assert fit_seq_len.searched_specs(["lora", "qlora"]) == ["lora", "qlora"]
    assert fit_seq_len.searched_specs(["lora", "baseline", "lora"]) == ["baseline", "lora"]
    assert fit_seq_len.searched_specs([]) == ["baseline"]


def test_predict_predicts_the_baseline_only_when_asked_for_or_alone(tmp_path):
    import pandas as pd

    def predicted(*strategies: str) -> list[str]:
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        assert main(["predict", "--workload", "deep_mlp:layers=2:width=8", "--batch-size", "2", "--device", "cpu",
                     "--phases", "train", *strategies, "--out", str(out)]) == 0
        return list(pd.read_csv(next(out.glob("predict-*.csv")))["strategy"])

    assert predicted("--strategies", "amp") == ["amp"]
    assert predicted("--strategies", "amp,baseline") == ["baseline", "amp"]
    assert predicted() == ["baseline"]


def test_a_searched_baseline_that_fits_at_no_length_costs_one_prediction():
    made = []

    def over_at_any_length(n: int) -> fit_seq_len.Probe:
        made.append(n)
        return fit_seq_len.Probe(n, 150 * 2**30 + n, 150 * 2**30 + n, "", "")

    class TwoSlots:  # the rounds' logic, two probes at once, in this process
        slots, lost = 2, ()

        def submit(self, function, *args):
            import concurrent.futures as futures
            future = futures.Future()
            future.set_result(function(*args))
            return future

    for pool in (None, TwoSlots()):
        made.clear()
        row = fit_seq_len.fit_seq_len("baseline", 24 * 2**30, "train", "cuda", "hf:tiny-llama", "synthetic", 1,
                                      step=8, start=8, judged_at=over_at_any_length, pool=pool)
        assert made == [8] and row.seq_len == 0 and row.next_judged_bytes == 150 * 2**30 + 8


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


@pytest.mark.parametrize("jobs", [2, 3])
def test_a_parabola_is_placed_by_three_probes(jobs):
    """Attention on the math kernel keeps a seq_len x seq_len matrix: the peak is a parabola in the tokens. The
    rounds place it by the parabola through three probes as soon as three are made: with three jobs in the second
    round (the line through the two nearest, before, took four rounds), with two in the third."""
    judged = lambda n: 16 * 2**30 + 900_000 * n + 180 * n * n  # noqa: E731
    budget = judged(6000)  # 5888 (23 x 256) is the longest multiple of 256 that fits
    rounds = Rounds()
    assert fit_seq_len.longest_under(judged, budget, 256, 131072, 2048, rounds, jobs) == 5888
    assert len(rounds.rounds) == {2: 3, 3: 2}[jobs] and 5888 + 256 in {n for r in rounds.rounds for n in r}


def test_the_polynomial_guess_is_exact_on_a_line_and_a_parabola_and_none_where_nothing_grows():
    line = lambda x: 100 + 7 * x  # noqa: E731
    assert polynomial_guess(line, {2, 4}, line(30), 4, 1000) == 30  # extrapolated from the two that fit
    parabola = lambda x: 50 + x + 3 * x * x  # noqa: E731
    assert polynomial_guess(parabola, {2, 4, 60}, parabola(41), 4, 60) == 41  # two that fit, one over
    assert polynomial_guess(parabola, {10, 20, 30}, parabola(45), 30, 1000) == 45  # three that fit, extrapolated
    flat = lambda x: 500  # noqa: E731
    assert polynomial_guess(flat, {2, 4}, 600, 4, 100) is None  # no growth: no guess, the bracket is split evenly
    assert largest_in_rounds(flat, lambda xs: None, 2, 600, 100, [2, 4]) == 100  # still answered, by doubling


def test_a_strategy_bends_its_first_guess_by_the_curvature_of_the_one_searched_before():
    """Two strategies of one model on math attention: parabolas of the same bend, offset by what the second saves.
    The first's probes give that bend (`curvature_of`: the second difference, exact on a parabola); with it the
    second's first guess lands on its answer, two rounds where the line through its two first probes takes three."""
    first = lambda n: 16 * 2**30 + 900_000 * n + 180 * n * n  # noqa: E731
    second = lambda n: 13 * 2**30 + 900_000 * n + 180 * n * n  # noqa: E731
    budget = 24 * 2**30
    rounds = Rounds()
    answer = fit_seq_len.longest_under(first, budget, 256, 131072, 2048, rounds, 2)
    probes = {n: fit_seq_len.Probe(n, first(n), first(n), "", "") for r in rounds.rounds for n in r}
    bend = fit_seq_len.curvature_of(probes, answer, 256)
    assert bend == 180 * 256 * 256  # bytes per step squared
    alone, bent = Rounds(), Rounds()
    assert fit_seq_len.longest_under(second, budget, 256, 131072, 2048, alone, 2) == 5888
    assert fit_seq_len.longest_under(second, budget, 256, 131072, 2048, bent, 2, bend) == 5888
    assert len(alone.rounds) == 3 and len(bent.rounds) == 2 and 5888 + 256 in bent.rounds[-1]
