"""Failures reported as what they are, and the sweep goes on: a usage error found inside a case, a CPU allocation
failure (`oom`), a loss that is not finite, a mismatch that says by how much, a model that never returns (`timeout`),
a model that takes its inputs as one dict, and fit when nothing fits or the allocator refuses a batch.
"""

import re
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

from bench.analysis import fit as analysis
from bench.cli.analysis_console import format_fit
from bench.core import results
from bench.core.errors import UsageError
from bench.run.isolation import RunOptions
from bench.run.case import Case
from bench.run.runner import run_cases
from cli_helpers import TINY, cli as _cli, main_in_process as _main, results_csv


def test_a_usage_error_raised_inside_one_case_is_its_row(temporary_strategy):
    """A strategy that finds a bad value only once it sees the model makes that case a row, never aborts the sweep."""
    from strategies import Strategy

    @temporary_strategy
    class PicksAFight(Strategy):
        name = "picks_a_fight"
        description = "raises a UsageError in prepare_model"

        def prepare_model(self, model, units):
            raise UsageError("picks_a_fight:level=9 is more than this model allows")

    cases = [Case("deep_mlp:layers=4:width=8", name, "eval", 2, "cpu", warmup=0, steps=1)
             for name in ("picks_a_fight", "baseline")]
    rows = run_cases(cases, options=RunOptions(threads=1))
    assert [r["status"] for r in rows] == ["unsupported", "ok"]
    assert "level=9" in rows[0]["message"]


def test_fit_on_the_cpu_survives_an_allocation_failure(monkeypatch):
    """Batches the allocator refuses are over the budget, not a traceback that loses what was measured."""
    real = analysis.measured_peak

    def refusing(case, strategy):
        if case.batch_size > 6:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 99999999 bytes")
        return real(case, strategy)

    monkeypatch.setattr(analysis, "measured_peak", refusing)
    # every probe fits, and no real first step equals its fake count: the full tracked runs must say no
    monkeypatch.setattr(analysis, "_probe_peak", lambda case, spec, **options: 1)
    [result] = analysis.fit([], 2**40, "eval", "cpu", "deep_mlp:layers=4:width=8", "synthetic", max_batch=64,
                            time_steps=0)
    assert 1 <= result.batch_size <= 6 and result.verified


HUNGRY = textwrap.dedent('''
    """A workload whose forward asks the CPU allocator for 4 EiB, which it refuses at once (nothing is allocated)."""
    import torch
    from torch import nn

    from workloads import Workload


    class Hungry(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            torch.empty(2**62, dtype=torch.uint8)
            return self.second(self.first(x))


    class HungryWorkload(Workload):
        name = "hungry"
        description = "asks for more memory than any machine has"
        default_batch_size = 2

        def build_model(self):
            torch.manual_seed(self.seed)
            return Hungry()

        def make_batch(self, batch_size, data="synthetic"):
            gen = torch.Generator().manual_seed(self.seed)
            return torch.randn(batch_size, 4, generator=gen), torch.randn(batch_size, 4, generator=gen)

        def loss(self, output, target):
            return nn.functional.mse_loss(output, target)

        def checkpoint_units(self, model):
            return [model.first, model.second]
''')


def test_a_cpu_allocation_failure_is_an_oom_row_and_a_run_without_success_exits_1(tmp_path):
    workload = tmp_path / "hungry.py"
    workload.write_text(HUNGRY)
    out = tmp_path / "out"
    done = _main("compare", "--strategies", "checkpoint", *TINY, "--workload", f"{workload}:HungryWorkload",
                "--out", out)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "no case succeeded" in done.stderr and "Traceback" not in done.stderr
    frame = results.read_results(next(out.glob("*.csv")))
    assert set(frame["status"]) == {"oom"}, frame[["status", "message"]]
    assert frame["message"].str.contains("can't allocate memory").all()


@pytest.mark.parametrize("budget", ["1KiB", "100KB"])
def test_fit_when_nothing_fits_names_the_smallest_peak_and_exits_1(budget, tmp_path):
    """A budget below every strategy's batch-1 peak (the search once probed batch 0 and crashed on its None): one
    line with the smallest peak reached, measured at batch 1, and exit 1; nothing else is printed or written."""
    workload = "deep_mlp:layers=4:width=64"
    done = _main("fit", "--budget", budget, "--workload", workload, "--max-batch", "64", "--time-steps", "0",
                "--strategies", "checkpoint", "--out", tmp_path)
    assert done.returncode == 1, done.stderr
    assert not list(tmp_path.iterdir())
    assert "Traceback" not in done.stderr
    [line] = done.stdout.splitlines()
    from bench.run.case import Case, bind_case
    from bench.run.runner import memory_pass

    case = Case(workload, "baseline", "train", 1, "cpu", data="synthetic", warmup=0, steps=1)
    peak = memory_pass(case, bind_case(case)[0], growth_steps=0)["peak_mem_bytes"]
    assert line.startswith("nothing fits in ") and f"({peak:,} B), baseline at batch 1" in line


def test_fit_never_prints_an_over_budget_peak_as_fitting():
    budget = 2**30
    over = analysis.FitResult("baseline", "train", "cpu", budget, 8, budget - 1, True, budget + 1000, "measured",
                              None, "", 2)
    line = format_fit([over], 0).splitlines()[2]
    peak, budget_cell, nxt = line.split()[3:6]
    assert float(peak.replace(",", "")) <= float(budget_cell.replace(",", "")) < float(nxt.replace(",", ""))


DICT_MODEL_WORKLOAD = '''
import torch
from torch import nn

from workloads import Workload


class TakesTheDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, batch):
        return self.linear(batch["mels"])


class DictWorkload(Workload):
    name = "dict_model"
    default_batch_size = 2
    whole = False  # True: the dict is passed as one argument, as the error message says to

    def build_model(self):
        torch.manual_seed(0)
        return TakesTheDict()

    def make_batch(self, batch_size, data):
        torch.manual_seed(1)
        inputs = {"mels": torch.randn(batch_size, 4)}
        return ((inputs,) if self.whole else inputs), torch.randint(0, 2, (batch_size,))

    def loss(self, output, target):
        return nn.functional.cross_entropy(output, target)


class WholeDictWorkload(DictWorkload):
    whole = True
'''


def test_a_model_that_takes_the_dict_whole_is_told_how_to_get_it(tmp_path):
    """Membench passes a dict of inputs as keyword arguments: a model whose forward takes the dict itself gets a row
    whose message says so and how to pass it whole; done that way, the case runs."""
    (tmp_path / "dict_workload.py").write_text(DICT_MODEL_WORKLOAD, encoding="utf-8")
    for name, status, code in (("DictWorkload", "error", 1), ("WholeDictWorkload", "ok", 0)):
        out = tmp_path / name
        done = _main("run", "--workload", f"{tmp_path / 'dict_workload.py'}:{name}", "--strategies", "baseline",
                     "--phases", "train", "--device", "cpu", "--steps", "1", "--warmup", "0", "--threads", "1",
                     "--no-isolate", "--out", out)
        assert done.returncode == code and "Traceback" not in done.stderr, done.stderr
        [row] = pd.read_csv(results_csv(out)).to_dict("records")
        assert row["status"] == status, row["message"]
    assert "keyword argument 'mels'" in row_message(tmp_path / "DictWorkload")
    assert "one-element tuple, `(inputs,)`" in row_message(tmp_path / "DictWorkload")


def row_message(out: Path) -> str:
    return pd.read_csv(results_csv(out))["message"].iloc[0]


NON_FINITE_WORKLOAD = '''
import torch
from torch import nn

from workloads import Workload


class NanLoss(Workload):
    """A loss that is NaN from the seeded start."""

    name = "nan_loss"
    default_batch_size = 2

    def build_model(self):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))

    def make_batch(self, batch_size, data):
        torch.manual_seed(1)
        return torch.randn(batch_size, 4), torch.randn(batch_size, 2)

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target) * float("nan")

    def checkpoint_units(self, model):
        return list(model)


class Diverges(NanLoss):
    """Finite at the seeded start; SGD's huge step overflows the weights, so the loss is not finite from step 2."""

    def loss(self, output, target):
        return (output - target).pow(2).mean()

    def make_optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=1e30)
'''


def _non_finite_run(tmp_path, name: str, command: str, *args) -> tuple[subprocess.CompletedProcess, pd.DataFrame]:
    (tmp_path / "non_finite.py").write_text(NON_FINITE_WORKLOAD, encoding="utf-8")
    out = tmp_path / name
    done = _main(command, *TINY, "--phases", "train", "--workload", f"{tmp_path / 'non_finite.py'}:{name}", *args,
                "--out", out)
    return done, pd.read_csv(results_csv(out))


def test_a_loss_that_is_not_finite_is_an_error_row_that_says_so_and_not_a_mismatch(tmp_path):
    """NaN from the first step: every row, the baseline's included, is an `error` saying the loss is not finite and
    where, never an `ok` row whose baseline does not match itself."""
    done, frame = _non_finite_run(tmp_path, "NanLoss", "compare", "--strategies", "checkpoint")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert list(frame["status"]) == ["error", "error"], frame[["strategy", "status", "message"]]
    assert not (frame["matches_baseline"] == False).any()  # noqa: E712 - a column of True/False/NaN
    baseline, checkpoint = frame["message"]
    assert baseline == "loss is not finite (nan) at step 1 (verification, from the seeded start)"
    assert checkpoint.startswith(baseline) and "the baseline's is nan too: the workload's loss" in checkpoint


def test_a_loss_that_stops_being_finite_later_is_an_error_row_naming_the_step(tmp_path):
    """Finite at the verified first step, not by the timing pass's last: the check after the timed steps."""
    done, frame = _non_finite_run(tmp_path, "Diverges", "run", "--strategies", "baseline", "--steps", "2")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    [row] = frame.to_dict("records")
    assert row["status"] == "error", row
    assert re.fullmatch(r"loss is not finite \((nan|inf)\) at step 2 \(the last of the timing pass\)", row["message"])


def test_a_row_that_does_not_match_says_which_check_by_how_much_and_against_which_tolerance(tmp_path):
    """`compare --workload deep_mlp --strategies amp` in eval: matches_baseline False and, in `message`, the check,
    the measured relative difference and the tolerance it exceeds (the message was empty)."""
    done = _main("compare", "--strategies", "amp", *TINY, "--workload", "deep_mlp", "--out", tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    frame = pd.read_csv(results_csv(tmp_path)).set_index("strategy")
    amp = frame.loc["amp"]
    assert amp["matches_baseline"] == False, amp  # noqa: E712
    match = re.search(r"output rel diff ([0-9.e+-]+) > output_rtol 0.05", amp["message"])
    assert amp["message"].startswith("differs from the baseline: ") and match, amp["message"]
    assert float(match.group(1)) == pytest.approx(amp["output_rel_diff"], rel=1e-2)
    assert pd.isna(frame.loc["baseline", "message"])


SLEEPY_WORKLOAD = '''
import time

HANGS_AT = None

import torch
from torch import nn

from workloads import Workload


class NeverReturns(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x):
        # stuck in Python, as a model waiting on something that never comes; with HANGS_AT set, only at that batch
        # on a real device (so that the pre-flight, on meta and at its calibration batches, passes)
        while HANGS_AT is None or (x.shape[0] == HANGS_AT and x.device.type != "meta"):
            time.sleep(0.05)
        return self.linear(x)


class Sleepy(Workload):
    name = "sleepy"
    default_batch_size = 2

    def build_model(self):
        torch.manual_seed(0)
        return NeverReturns()

    def make_batch(self, batch_size, data):
        torch.manual_seed(1)
        return torch.randn(batch_size, 4), torch.randn(batch_size, 2)

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)
'''


@pytest.mark.slow  # among the longest of make test: CI runs it in its step of long tests (.ci/run)
def test_a_model_that_never_returns_is_a_timeout_row_and_the_sweep_goes_on(tmp_path):
    """--case-timeout 20: the case whose forward never returns is killed at its deadline, its row says `timeout` and
    where it was, and the next case runs (the run hung with no output). The model hangs at the sweep's
    batch on the CPU only: the pre-flight's own bound is the next test's. 20 s, not 5 or 10: on a loaded 2-core
    machine a worker's import of torch alone took 5.7 s, and at a load average of 10 (the suite in two processes
    beside other sessions) the healthy deep_mlp case timed out at 10 s, in its memory pass, beside the stuck one."""
    (tmp_path / "sleepy.py").write_text(SLEEPY_WORKLOAD.replace("HANGS_AT = None", "HANGS_AT = 3"), encoding="utf-8")
    limit, out = 20, tmp_path / "out"
    started = time.monotonic()
    done = _cli("run", "--strategies", "baseline", "--workload", f"{tmp_path / 'sleepy.py'}:Sleepy,deep_mlp:layers=4",
                "--phases", "eval", "--batch-size", "3", "--device", "cpu", "--warmup", "0", "--steps", "1",
                "--threads", "1", "--case-timeout", limit, "--out", out, timeout=180)
    elapsed = time.monotonic() - started
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    sleepy, mlp = pd.read_csv(results_csv(out)).to_dict("records")
    assert sleepy["status"] == "timeout" and mlp["status"] == "ok", (sleepy, mlp)
    assert sleepy["message"] == (f"the case did not finish within --case-timeout {limit} s; its worker "
                                 "was killed during verification"), sleepy["message"]
    assert sleepy["isolated"] and mlp["isolated"]
    assert elapsed < 2 * limit + 60, elapsed


@pytest.mark.slow  # in .ci/run's long tests of make test
def test_the_pre_flight_of_a_model_that_never_returns_ends_at_its_bounds(tmp_path):
    """The pre-flight runs the user's forward too (the meta-device memory estimate, then two calibration steps on
    the CPU), each bounded (here 2 s and 2 s, in the child process --isolate uses): a model that never returns
    leaves no note, and the run goes on to its cases instead of hanging before the first."""
    from bench.cli import preflight_steps

    (tmp_path / "sleepy.py").write_text(SLEEPY_WORKLOAD, encoding="utf-8")
    case = Case(f"{tmp_path / 'sleepy.py'}:Sleepy", "baseline", "eval", 2, "cpu")
    started = time.monotonic()
    assert preflight_steps.user_code_steps_in_child([case], True, 2.0, 2.0) is None
    elapsed = time.monotonic() - started
    assert elapsed < 30, elapsed  # the child's start (a few seconds), both bounds; unbounded it would never end


def test_a_pre_flight_bound_told_once_and_swallowed_tells_again():
    """A TimeoutError that the code under the bound swallows (a library's `except Exception`) is raised again, so
    that a model that never returns still ends; a single alarm would leave it running for ever (the CI flake of
    the test above: 64 s against its 30)."""
    from bench.cli.preflight_steps import _bounded

    def swallows_the_first_then_never_returns():
        try:
            while True:
                time.sleep(0.01)
        except TimeoutError:
            pass
        deadline = time.monotonic() + 5  # the test's own way out: "never" is five seconds here
        while time.monotonic() < deadline:
            time.sleep(0.01)
        return "never told again"

    previous = signal.getsignal(signal.SIGALRM)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        _bounded(0.1, swallows_the_first_then_never_returns)()
    assert time.monotonic() - started < 2
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) is previous


def test_a_pre_flight_bound_never_cuts_an_import_short(tmp_path, monkeypatch):
    """The bound expires after an import under way has finished, not inside it: an import cut short leaves a
    half-made module behind, and every later step of the process fails on it (`module 'sympy' has no attribute
    'core'`, seen with bounds short enough to expire inside membench's own imports)."""
    import sys

    from bench.cli.preflight_steps import _bounded

    (tmp_path / "slow_to_import_for_membench.py").write_text(
        "import time\nstarted = time.monotonic()\nwhile time.monotonic() - started < 0.5:\n    time.sleep(0.01)\n"
        "MADE = True\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))

    def imports_then_never_returns():
        import slow_to_import_for_membench  # noqa: F401
        while True:
            time.sleep(0.01)

    try:
        with pytest.raises(TimeoutError):
            _bounded(0.1, imports_then_never_returns)()
        assert sys.modules["slow_to_import_for_membench"].MADE
    finally:
        sys.modules.pop("slow_to_import_for_membench", None)
