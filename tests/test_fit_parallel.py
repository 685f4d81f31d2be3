"""Fit's probes several at once (`--jobs`, local worker processes; Ray in tests/test_ray.py).

Asserted: with jobs > 1 both searches (the largest batch, `fit_search.largest_under`; the longest sequence,
`fit_seq_len.longest_under`) answer what the serial search answers, on peaks of several shapes, always having probed
the step past the answer, in fewer rounds than the serial search makes probes; the serial search's probes are
those it made before (the committed reference results were made with them); and a real fit on the CPU, its probes
in forked worker processes, gives the rows the serial fit gives, for the batch (fake-tensor probes, then tracked
runs) and for the sequence length (predictions).
"""

from __future__ import annotations

import concurrent.futures as futures
import dataclasses
import math

import pytest

from bench.analysis import fit as fitting
from bench.analysis import fit_seq_len, pools
from bench.analysis.fit_search import Probes, largest_under
from bench.cli.main import main

BATCH_PEAKS = {
    "linear": lambda b: 100_000 + 3_000 * b,
    "curved": lambda b: 50_000 + 700 * b + 9 * b * b,
    "stairs": lambda b: 80_000 + 20_000 * (b // 8),  # flat stretches: the line between two ends is off
    "a cliff past 200": lambda b: 1_000 * b if b <= 200 else 10**9 * b,
}


class Rounds:
    """A prefetch that records each round of probes (several at once) and the points probed."""

    def __init__(self):
        self.rounds: list[list[int]] = []

    def __call__(self, points: list[int]) -> None:
        self.rounds.append(list(points))

    def probed(self) -> set[int]:
        return {x for r in self.rounds for x in r}


@pytest.mark.parametrize("shape", BATCH_PEAKS)
@pytest.mark.parametrize("jobs", [2, 4])
def test_the_batch_search_in_rounds_answers_what_the_serial_search_answers(shape, jobs):
    peak = BATCH_PEAKS[shape]
    for budget in (1, 60_000, 150_000, 200_000, 1_000_000, 3_000_000, 10**12):
        for max_batch in (4, 20, 32, 100, 4096):
            serial = largest_under(peak, budget, 16, 32, max_batch)
            rounds = Rounds()
            parallel = largest_under(peak, budget, 16, 32, max_batch, rounds, jobs)
            assert parallel == serial, (shape, budget, max_batch)
            assert all(len(r) <= jobs for r in rounds.rounds)
            if 0 < parallel < max_batch:  # the batch past the answer was probed: the row of the first that does not fit
                assert parallel + 1 in rounds.probed() | {16, 32}


def test_the_serial_batch_search_answers_no_more_than_max_batch():
    """With --max-batch below the search's second point (32) the bisection between a fitting batch and 32 once
    answered above the cap: `fit --budget 6144 --workload deep_mlp:layers=4:width=8 --max-batch 4` said 7, "capped
    by --max-batch 4". Its probes are unchanged; its answer is the cap."""
    probes = []
    peak = lambda b: probes.append(b) or 5312 + 128 * b  # noqa: E731 - near that model's fake counts
    assert largest_under(peak, 6144, 16, 32, 4) == 4  # 6 before
    assert list(dict.fromkeys(probes)) == [32, 16, 4, 18, 11, 7, 5, 6]  # as before (commit 8849a95)


def test_a_linear_peak_is_answered_in_two_rounds_where_the_serial_search_probes_one_at_a_time():
    calls = []
    peak = BATCH_PEAKS["linear"]
    assert largest_under(lambda b: calls.append(b) or peak(b), 1_000_000, 16, 32, 4096) == 300
    rounds = Rounds()
    assert largest_under(peak, 1_000_000, 16, 32, 4096, rounds, 2) == 300
    assert rounds.rounds == [[16, 32], [300, 301]] and len(set(calls)) == 4  # 16, 32, then 300 and 301 in turn


SEQ_PEAKS = {
    "linear": lambda n: 10_000 + 7 * n,
    "quadratic": lambda n: n * n,
    "no prediction past 6000": lambda n: 40 * n if n <= 6000 else None,  # counts as over the budget
    "flat, then steep": lambda n: 1_000_000 if n < 3000 else 1_000_000 + 500 * (n - 3000),
}


@pytest.mark.parametrize("shape", SEQ_PEAKS)
@pytest.mark.parametrize("jobs", [2, 3])
def test_the_sequence_search_in_rounds_answers_what_the_serial_search_answers(shape, jobs):
    judged = SEQ_PEAKS[shape]
    for budget in (5_000, 40_000, 1_000_000, 1_300_000, 9_000_000, 2 * 10**9):
        for start, max_seq in ((2048, 131072), (256, 8192), (2048, 1024)):
            serial = fit_seq_len.longest_under(judged, budget, 256, max_seq, start)
            rounds = Rounds()
            parallel = fit_seq_len.longest_under(judged, budget, 256, max_seq, start, rounds, jobs)
            assert parallel == serial, (shape, budget, start, max_seq)
            if parallel + 256 <= max_seq:
                assert parallel + 256 in rounds.probed()


def test_the_serial_searches_probe_as_they_did():
    """Jobs=1 keeps the probes of the searches that made results/reference/fit and results/reference/longest_context
    (recorded from the code of commit 8849a95, before probes ran several at once), in their order."""
    probes = []
    assert fit_seq_len.longest_under(lambda n: probes.append(n) or 10_000 + 7 * n, 10_000 + 7 * 5000, 256,
                                     131072) == 4864
    assert probes == [2048, 4096, 8192, 4864, 6400, 5120]
    probes.clear()
    assert fit_seq_len.longest_under(lambda n: probes.append(n) or n * n, 3000**2, 256, 131072) == 2816
    assert probes == [2048, 4096, 2816, 3328, 3072]
    probes.clear()
    assert largest_under(lambda b: probes.append(b) or BATCH_PEAKS["curved"](b), 1_000_000, 16, 32, 4096) == 288
    assert list(dict.fromkeys(probes)) == [32, 16, 843, 139, 210, 315, 284, 288, 289]


class InlineOf(pools.Inline):
    """This process, offering `slots` jobs: the rounds' logic without worker processes."""

    def __init__(self, slots: int):
        self.slots = slots


def test_a_probe_whose_worker_died_is_over_the_budget_and_the_search_goes_on():
    """A lost worker's probe (for --over seq_len: no prediction, a message saying so) counts as over the budget."""
    class Lost(Exception):
        pass

    class Dying(InlineOf):
        lost = (Lost,)

        def submit(self, function, *args):
            if args[0] != 4096:
                return super().submit(function, *args)
            future: futures.Future = futures.Future()
            future.set_exception(Lost("worker killed"))
            return future

    probes = Probes(SEQ_PEAKS["linear"], lambda n: (n,), Dying(2), lost=fit_seq_len._lost_probe)
    probes.prefetch([2048, 4096])
    assert probes.values[2048] == SEQ_PEAKS["linear"](2048)
    assert probes.values[4096].judged_bytes is None and "worker killed" in probes.values[4096].message
    result = fit_seq_len.fit_seq_len("baseline", 10_000 + 7 * 6000, "train", "cpu", "hf:tiny-llama", "synthetic",
                                     1, max_seq=131072, judged_at=_linear_probe, pool=Dying(2))
    assert result.seq_len == 3840 and result.next_judged_bytes is None  # 4096 tokens: its worker died


def _linear_probe(seq_len: int) -> fit_seq_len.Probe:
    value = SEQ_PEAKS["linear"](seq_len)
    return fit_seq_len.Probe(seq_len, value, value, "", "")


# --- real fits on the CPU, probes in forked worker processes ---------------------------------------------------

WORKLOAD = "deep_mlp:layers=4:width=16"


def _without_time(result) -> dict:
    return {k: v for k, v in dataclasses.asdict(result).items() if k not in ("time_per_sample_ms", "note")}


@pytest.mark.slow  # 9 s on 2 cores at load 6: two fits, tracked runs included
def test_a_cpu_fit_with_its_probes_in_two_processes_gives_the_serial_fits_rows():
    """The largest batch under the budget, its peak and the row of the batch after it (measured or from the probes)
    are the serial fit's."""
    budget = fitting._probe_peak(fitting.Case(WORKLOAD, "baseline", "train", 40, "cpu", data="synthetic", warmup=0,
                                              steps=1), "baseline")  # batch 40's count: the baseline's answer
    serial = fitting.fit([], budget, "train", "cpu", WORKLOAD, "synthetic", 4096, time_steps=0)
    parallel = fitting.fit([], budget, "train", "cpu", WORKLOAD, "synthetic", 4096, time_steps=0, jobs=2)
    assert serial[0].batch_size == 40
    assert [_without_time(r) for r in parallel] == [_without_time(r) for r in serial]
    assert all(r.next_batch_peak_bytes > budget >= r.peak_bytes for r in serial)


@pytest.mark.slow  # 20 s on 2 cores at load 6: two searches of predictions of hf:tiny-llama
def test_the_longest_sequence_with_its_predictions_in_two_processes_is_the_serial_searchs():
    pytest.importorskip("transformers")
    budget = 1_700_000  # between the predicted peaks at 8 and at 128 tokens of hf:tiny-llama
    args = (["baseline"], budget, "train", "cpu", "hf:tiny-llama", "synthetic", 1, 8)
    serial = fit_seq_len.fit_over_seq_len(*args)
    parallel = fit_seq_len.fit_over_seq_len(*args, jobs=2)
    keys = ("seq_len", "peak_bytes", "judged_bytes", "next_batch_peak_bytes", "next_judged_bytes", "peak_by", "note")
    assert [[getattr(r, k) for k in keys] for r in parallel] == [[getattr(r, k) for k in keys] for r in serial]
    assert 8 <= serial[0].seq_len < 128 and serial[0].judged_bytes <= budget < serial[0].next_judged_bytes
    assert all(r.monotonic_check.startswith("non-decreasing") for r in serial + parallel)


# --- the options ---------------------------------------------------------------------------------------------------

PLAN = ["plan", "--budget", "1GiB", "--device", "cpu", "--workload", WORKLOAD]
FIT = ["fit", "--budget", "1MiB", "--workload", WORKLOAD]


@pytest.mark.parametrize("argv, words", [
    (PLAN + ["--executor", "spark"], ["'spark'", "local, ray"]),
    (FIT + ["--executor", "spark"], ["'spark'", "local, ray"]),
    (PLAN + ["--ray-address", "auto"], ["--ray-address needs --executor ray"]),
    (FIT + ["--ray-address", "auto"], ["--ray-address needs --executor ray"]),
    (PLAN + ["--executor", "ray", "--ray-address", "head:99999"], ["'head:99999'", "ray://host:port"]),
    (FIT + ["--executor", "ray", "--ray-address", "no such host"], ["'no such host'", "host:port"]),
    (["fit", "--gpu", "RTX 4090", "--executor", "ray"], ["--executor ray", "--device cpu", "--over seq_len"]),
    (FIT + ["--jobs", "0"], ["--jobs", "'0'"]),
    (PLAN + ["--executor", "ray", "--ray-address", "127.0.0.1:1"], ["127.0.0.1:1", "cannot reach"]),
])
def test_bad_executor_options_of_plan_and_fit_are_one_line_and_exit_2(argv, words, capsys, tmp_path):
    assert main(argv + ["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert all(word in err for word in words), err
    assert not list(tmp_path.iterdir())
