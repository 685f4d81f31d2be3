"""CI's step budgets (.ci/steps.sh, sourced by .ci/run): a step over its budget, or a run over its total budget,
fails the run once every step has run; a failing step still stops the run with its own exit code; each step's
duration is printed against its budget; on a slower machine the budgets scale by its measured speed."""

import re
import runpy
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ci(script: str, **variables: str) -> subprocess.CompletedProcess:
    """Runs `script` after sourcing .ci/steps.sh as .ci/run does, in bash with .ci/run's options."""
    variables = {"CI_SPEED_FACTOR": "1", **variables}  # the reference machine's budgets, unless a test says
    return subprocess.run(["bash", "-c", f"set -euo pipefail; source .ci/steps.sh; {script}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/local/bin:/usr/bin:/bin", **variables})


def test_steps_within_their_budgets_pass_and_print_their_durations():
    done = _ci('step "quick" 30 true; step "also quick" 30 true')
    assert done.returncode == 0, done.stderr
    assert re.search(r"\[ci\]   quick: \d+ s \(budget 30 s = 30 s x 1.00\)", done.stdout), done.stdout
    assert re.search(r"\[ci\] total: \d+ s \(budget 2700 s\)", done.stdout), done.stdout
    assert "OVER BUDGET" not in done.stderr


def test_a_step_over_its_budget_fails_the_run_after_the_later_steps_ran():
    done = _ci('step "slow" 0 sleep 1.1; step "later" 30 true')
    assert done.returncode == 1
    # whole seconds of bash's SECONDS: a 1.1 s sleep reads 1 or 2 (2 under load, or begun late in a second)
    assert re.search(r"OVER BUDGET: slow took [12] s, over its budget of 0 s", done.stderr), done.stderr
    assert "[ci]   later:" in done.stdout, "the steps after the one over budget still run"


def test_a_run_over_its_total_budget_fails():
    done = _ci('step "one" 30 sleep 1.1', CI_TOTAL_BUDGET_S="0")
    assert done.returncode == 1
    assert re.search(r"OVER BUDGET: the whole run took [12] s, over its budget of 0 s", done.stderr), done.stderr


@pytest.mark.parametrize("factor,step_budget,total_budget", [("2.5", 75, 4800), ("1.4", 42, 3780), ("0.6", 30, 2700)])
def test_a_slower_machine_scales_every_budget_and_the_total_stops_short_of_cis_own_limit(factor, step_budget,
                                                                                      total_budget):
    """2.5x slower: a 30 s budget is 75 s, the 45 minutes 112 but held at 80; a faster machine keeps the budgets."""
    done = _ci('step "quick" 30 true', CI_SPEED_FACTOR=factor)
    assert done.returncode == 0, done.stderr
    assert re.search(rf"\[ci\]   quick: \d+ s \(budget {step_budget} s = 30 s x ", done.stdout), done.stdout
    assert re.search(rf"\[ci\] total: \d+ s \(budget {total_budget} s\)", done.stdout), done.stdout


def test_without_a_factor_the_machine_is_sampled_through_the_run():
    done = _ci('step "sampled" 30 sleep 2', CI_SPEED_FACTOR="", CI_SPEED_EVERY_S="0.5")
    assert done.returncode == 0, done.stderr
    said = re.search(r"ran Python ([\d.]+) times as slowly as the reference machine \(the median of (\d+) samples, "
                     r"([\d.]+) s;", done.stdout)
    assert said and float(said.group(1)) >= 1 and int(said.group(2)) >= 2 and float(said.group(3)) > 0, done.stdout
    factor = re.search(r"sampled: \d+ s \(budget (\d+) s = 30 s x ([\d.]+)\)", done.stdout)
    assert factor and int(factor.group(1)) == int(30 * float(factor.group(2)) + 0.5), done.stdout


@pytest.mark.parametrize("code", [2, 3])
def test_a_failing_step_stops_the_run_with_its_own_exit_code(code):
    done = _ci(f'step "fails" 30 bash -c "exit {code}"; step "never" 30 true')
    assert done.returncode == code
    assert "never" not in done.stdout


def test_ci_run_gives_every_step_a_budget():
    """Every `step` line of .ci/run names a budget; make test's is its 10-minute goal at most."""
    steps = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("step ")]
    budgets = {}
    for line in steps:
        match = re.match(r'step "([^"]+)" (\d+) ', line)
        assert match, f"a step without a budget: {line}"
        budgets[match.group(1)] = int(match.group(2))
    assert budgets["make test"] <= 600, "make test's goal is 10 minutes"
    assert {"set-up", "make test", "make test-cuda-fake", "anchors against the reference"} <= budgets.keys()


def test_a_steps_factor_is_the_median_of_the_samples_taken_while_it_ran(tmp_path):
    speed = runpy.run_path(str(ROOT / ".ci" / "machine_speed.py"))
    samples = tmp_path / "samples"
    reference = speed["REFERENCE_S"]
    samples.write_text("".join(f"{ended} {reference * slower}\n" for ended, slower in
                               [(100.0, 1.0), (200.0, 3.0), (210.0, 2.0), (220.0, 2.5)]))
    assert speed["factor"](str(samples), since=150.0) == pytest.approx(2.5)  # 3.0, 2.0 and 2.5
    assert speed["factor"](str(samples), since=0.0) == pytest.approx(2.25)  # all four
    assert speed["factor"](str(samples), since=300.0) == pytest.approx(2.25)  # none after: all of them
