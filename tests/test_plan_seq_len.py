"""`plan --over seq_len` (bench.analysis.plan_seq_len): the plan that trains the longest sequence under a limit.

Asserted over synthetic peaks (each technique a factor on the tokens' share, the weights fixed): the answer is the
longest of every candidate the search considers, computed exhaustively, so pruning never loses it; a candidate ruled
out by one probe is truly shorter than that probe; a setting that does not reach beyond the baseline never enters a
combination; one that changes what is trained is kept out of the answer; a search cut short says what it did not
try. Then the command on a real small model (predictions on the CPU), and its bad options: one line, exit 2.
"""

from __future__ import annotations

import itertools
import math

import pandas as pd
import pytest

from bench.analysis import fit_seq_len, plan, plan_seq_len
from bench.analysis.fit_seq_len import Probe
from bench.cli.main import main
from bench.core.results import FIT
from workloads import get_workload

WORKLOAD = "gpt_mini:layers=1:width=32:heads=2:seq_len=64:dropout=0.0"
STEP = 64
LONGEST = 8192
WEIGHTS, PER_TOKEN = 1_000_000, 2_000
FACTORS = {"checkpoint": 0.5, "checkpoint:segments=sqrt": 0.6, "checkpoint:segments=all": 0.45, "amp": 0.7,
           "chunked_loss": 0.8, "grad_accumulation": 0.55, "bf16_weights": 0.2}


def judged(spec: str, seq_len: int) -> int:
    factor = math.prod(FACTORS.get(member, 1.0) for member in spec.split("+") if member != "baseline")
    return int(WEIGHTS + PER_TOKEN * seq_len * factor)


def true_longest(spec: str, limit: int) -> int:
    return max((n for n in range(STEP, LONGEST + 1, STEP) if judged(spec, n) <= limit), default=0)


def request(limit: int, **changes) -> plan.PlanRequest:
    values = dict(workload=get_workload(WORKLOAD).spec(), data="synthetic", batch_size=2, device="cpu",
                  target="this CPU", limit_bytes=limit, context_bytes=0, figures={},
                  strategies=["checkpoint", "amp", "chunked_loss", "grad_accumulation", "bf16_weights"],
                  max_search_s=3600, max_candidates=200)
    values.update(changes)
    return plan.PlanRequest(**values)


def search(limit: int, **changes):
    probes: list[tuple[str, int]] = []

    def probe(case):
        seq_len = get_workload(case.workload).settings["seq_len"]
        probes.append((case.strategy, seq_len))
        value = judged(case.strategy, seq_len)
        return Probe(seq_len, value, value, "", "")

    found = plan_seq_len.longest_plan(request(limit, **changes), STEP, LONGEST, probe=probe)
    return found, probes


@pytest.mark.parametrize("limit", [1_300_000, 2_000_000, 5_000_000])
def test_the_answer_is_the_longest_of_every_candidate_and_pruning_loses_nothing(limit):
    found, probes = search(limit)
    assert found.results[0].strategy == "baseline"
    considered = {r.strategy for r in found.results}
    eligible = {s for s in considered if s not in found.differs}
    best = max(true_longest(s, limit) for s in eligible)
    assert found.answer is not None and found.answer.seq_len == best == true_longest(found.answer.strategy, limit)
    assert found.differs.keys() == {"bf16_weights"}  # the longest alone (factor 0.2), but it changes the training
    assert "bf16_weights" not in found.answer.strategy
    for result in found.results:
        made = [n for spec, n in probes if spec == result.strategy]
        if result.seq_len is None and not made:  # the longest found is the longest tried: nothing can beat it
            assert best == LONGEST and "beyond the longest sequence tried" in result.note
        elif result.seq_len is None:  # ruled out by one probe, truly shorter than it
            assert len(made) == 1 and true_longest(result.strategy, limit) < made[0]
            assert judged(result.strategy, made[0]) == result.next_judged_bytes > limit
        else:
            assert result.seq_len == true_longest(result.strategy, limit)
            assert result.judged_bytes <= limit < (result.next_judged_bytes or math.inf)
    # the answer's tie-break: no other candidate reaching as far has fewer techniques
    ties = [r for r in found.results if r.seq_len == best and r.strategy in eligible]
    assert found.answer.strategy.count("+") == min(r.strategy.count("+") for r in ties)
    assert sorted(found.tied) == sorted(r.strategy for r in ties if r is not found.answer)


def test_combinations_are_of_the_settings_that_reach_beyond_the_baseline():
    limit = 2_000_000
    found, _ = search(limit)
    base = true_longest("baseline", limit)
    singles = [r.strategy for r in found.results if "+" not in r.strategy and r.strategy != "baseline"]
    useful = {s for s in singles if true_longest(s, limit) > base and s not in found.differs}
    combined = [r.strategy for r in found.results if "+" in r.strategy]
    assert combined and all(set(s.split("+")) <= useful for s in combined)
    assert {frozenset(s.split("+")) for s in combined if s.count("+") == 1} >= {
        frozenset(pair) for pair in itertools.combinations(useful, 2)
        if len({m.split(":")[0] for m in pair}) == 2}  # two settings of one strategy never combine


def test_a_search_cut_short_names_what_it_did_not_try():
    found, _ = search(2_000_000, max_candidates=3)
    assert found.stopped == "count" and len(found.results) == 3 and found.untried
    assert not set(found.untried) & {r.strategy for r in found.results}


def test_nothing_fits_even_one_step():
    found, probes = search(WEIGHTS)
    assert found.answer is None and all(r.seq_len is None for r in found.results)
    assert all(n == STEP for _, n in probes)  # one probe each, at the shortest length


@pytest.mark.slow  # a real search of 4 candidates (about 30 probes): CI runs it (.ci/run)
def test_the_command_on_a_small_model(tmp_path, capsys):
    code = main(["plan", "--workload", WORKLOAD, "--budget", "3MiB", "--device", "cpu", "--over", "seq_len",
                 "--batch-size", "2", "--seq-step", "32", "--max-seq-len", "1024", "--strategies", "checkpoint",
                 "--max-search-s", "600", "--jobs", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    (csv,) = tmp_path.glob("fit-*.csv")
    frame = pd.read_csv(csv, comment="#")
    assert set(frame.columns) >= set(FIT.names) - {"schema_version"} and (frame["over"] == "seq_len").all()
    answer = out.split("answer: ")[1].split(": ")[0]
    longest = int(frame.loc[frame["strategy"] == answer, "seq_len"].iloc[0])
    assert longest == frame["seq_len"].max() > 0
    # the answer, predicted on its own, fits; one step more does not (the same predictions)
    row = frame.loc[frame["strategy"] == answer].iloc[0]
    assert row["judged_bytes"] <= 3 * 2**20 * 0.95 < row["next_judged_bytes"]
    assert "check it: python -m bench predict" in out


@pytest.mark.parametrize("extra, named", [
    (["--max-ranks", "2"], "--ranks/--max-ranks"),
    (["--over", "tokens"], "tokens"),
    (["--confirm"], "--confirm"),
])
def test_bad_options_are_one_line(extra, named, tmp_path, capsys):
    args = ["plan", "--workload", WORKLOAD, "--budget", "3MiB", "--device", "cpu", "--out", str(tmp_path)]
    if "--over" not in extra:
        args += ["--over", "seq_len"]
    code = main(args + extra)
    err = capsys.readouterr().err.strip()
    assert code == 2 and named in err and len(err.splitlines()) == 1, err


def test_a_workload_without_a_sequence_is_refused(tmp_path, capsys):
    code = main(["plan", "--workload", "deep_mlp", "--budget", "3MiB", "--device", "cpu", "--over", "seq_len",
                 "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "seq_len" in err and len(err.splitlines()) == 1, err
    assert fit_seq_len  # the refusal is fit_seq_len.seq_len_spec's
