"""Sweeps: kill-and-resume, isolation, crashed workers, no leaking flags, repeats with a CI, threads.

Kept cheap for a loaded 2-core machine: eval phase (forward only), batch <= 3, synthetic data, 1-2 steps,
one thread per case.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch

from bench.cli.console import format_table
from bench.cli.main import main
from bench.core import results
from bench.core.errors import UsageError
from bench.measure.stats import bootstrap_median_ci, summarize_timing
from bench.run.isolation import RunOptions, process_state
from bench.run.resume import load_resume
from bench.run.case import Case
from bench.run.runner import run_case, run_cases
from strategies import STRATEGIES, Strategy
from strategies.cudnn_benchmark import CudnnBenchmark

ROOT = Path(__file__).resolve().parent.parent
ONE_THREAD = RunOptions(threads=1)


def _case(strategy="baseline", batch_size=2, steps=1, phase="eval"):
    return Case("captcha_resnet18", strategy, phase, batch_size, "cpu", data="synthetic", warmup=0, steps=steps)


# --- resume ----------------------------------------------------------------------------------------------

RUN_ARGS = ["--strategies", "baseline", "--phases", "eval", "--batch-size", "1,2,3", "--device", "cpu",
            "--data", "synthetic", "--warmup", "0", "--steps", "1", "--threads", "1", "--no-isolate"]


@pytest.mark.slow  # in .ci/run's long tests of make test
def test_a_killed_sweep_resumes_and_holds_each_case_once(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "bench", "run", *RUN_ARGS, "--out", str(out)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 150
    csv = None
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            found = list(out.glob("*.csv"))
            if found and len(results.read_results(found[0])) >= 1:
                csv = found[0]
                break
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert csv is not None, proc.stderr.read().decode()[-2000:]
    before = results.read_results(csv)  # readable after SIGKILL: never a half-written row
    assert 1 <= len(before) <= 3 and (before["status"] == "ok").all()

    assert main(["run", *RUN_ARGS, "--resume", str(csv)]) == 0
    after = results.read_results(csv)
    assert sorted(after["batch_size"]) == [1, 2, 3]
    assert not after.duplicated(results.CASE_KEY).any()
    assert after["run_id"].nunique() == 1 and after["run_id"][0] == before["run_id"][0]
    # the finished rows were kept, not measured again
    kept = after.set_index("batch_size").loc[before["batch_size"], "timestamp"].tolist()
    assert kept == before["timestamp"].tolist()
    assert list(tmp_path.glob("out/*.csv")) == [csv]


def _stored_run(path, statuses, warmup=0, steps=1, threads=1):
    rows = [{"workload": "captcha_resnet18", "strategy": "baseline", "phase": "eval", "device": "cpu",
             "batch_size": bs, "data": "synthetic", "status": status, "run_id": "r1", "warmup_steps": warmup,
             "measured_steps": steps, "repeats": 1, "cpu_threads": threads, "deterministic": False,
             "isolated": False} for bs, status in statuses]
    results.write_rows(rows, path)
    return path


def test_resume_skips_finished_cases_and_reruns_errors(tmp_path):
    path = _stored_run(tmp_path / "r1.csv", [(1, "ok"), (2, "error"), (3, "unsupported"), (5, "timeout")])
    cases = [_case(batch_size=bs) for bs in (1, 2, 3, 4, 5)]
    resumed = load_resume(path, cases, ONE_THREAD)
    assert resumed.run_id == "r1"
    assert [c.batch_size for c in resumed.remaining] == [2, 4]  # a timed-out case is not walked back into
    assert sorted(r["batch_size"] for r in resumed.rows) == [1, 3, 5]


@pytest.mark.parametrize("change, named", [
    (dict(steps=5), "measured_steps"), (dict(warmup=2), "warmup_steps"), (dict(threads=2), "cpu_threads"),
])
def test_resume_refuses_different_measurement_options(tmp_path, change, named):
    path = _stored_run(tmp_path / "r1.csv", [(1, "ok")], **change)
    with pytest.raises(UsageError, match=named):
        load_resume(path, [_case()], ONE_THREAD)


@pytest.mark.parametrize("stored, requested, named", [
    (dict(timing_fixed_steps=3), dict(steps=None), "timing_fixed_steps: file has 3, requested adaptive timing"),
    (dict(timing_min_steps=5, timing_max_time_s=30.0, timing_target_ci_rel=0.05),
     dict(steps=None, max_time_s=10.0), "timing_max_time_s: file has 30.0, requested 10.0"),
])
def test_resume_refuses_other_timing_options(tmp_path, stored, requested, named):
    path = tmp_path / "r1.csv"
    results.write_rows([{**results.read_results(_stored_run(path, [(1, "ok")])).iloc[0].to_dict(), **stored}], path)
    case = _case()
    with pytest.raises(UsageError, match=named):
        load_resume(path, [replace(case, **requested)], ONE_THREAD)


def test_resume_of_a_missing_file_is_a_usage_error(tmp_path, capsys):
    assert main(["run", *RUN_ARGS, "--resume", str(tmp_path / "nope.csv")]) == 2
    assert "nope.csv" in capsys.readouterr().err


# --- isolation ---------------------------------------------------------------------------------------------

CRASHER = textwrap.dedent("""
    import os, signal, sys
    from strategies import Strategy, register_strategy

    @register_strategy
    class ExitThree(Strategy):
        name = "test_exit_three"
        def check(self, context):
            print("about to fail on purpose", file=sys.stderr, flush=True)
            os._exit(3)

    @register_strategy
    class Segfault(Strategy):
        name = "test_segfault"
        def check(self, context):
            os.kill(os.getpid(), signal.SIGSEGV)
""")


@pytest.fixture(scope="module")
def isolated_sweep(tmp_path_factory):
    """One isolated sweep: two crashing workers, then the baseline (which must still run)."""
    plugins = tmp_path_factory.mktemp("plugins")
    (plugins / "membench_test_crashers.py").write_text(CRASHER)
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "MEMBENCH_PLUGINS")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(plugins), saved["PYTHONPATH"]) if p)
    os.environ["MEMBENCH_PLUGINS"] = "membench_test_crashers"
    out = tmp_path_factory.mktemp("isolated") / "run.csv"
    try:
        cases = [_case("test_exit_three"), _case("test_segfault"), _case("baseline")]
        rows = run_cases(cases, out, options=RunOptions(isolate=True, threads=1))
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return rows, out


@pytest.mark.slow  # in .ci/run's long tests of make test
def test_a_crashing_worker_becomes_an_error_row_and_the_sweep_goes_on(isolated_sweep):
    rows, out = isolated_sweep
    assert [r["status"] for r in rows] == ["error", "error", "ok"]
    assert "exit code 3" in rows[0]["message"] and "about to fail on purpose" in rows[0]["message"]
    assert "SIGSEGV" in rows[1]["message"]
    assert len(results.read_results(out)) == 3
    assert all(not k.startswith("_") for r in rows for k in r)


@pytest.mark.slow  # in .ci/run's long tests of make test (shares the crashing sweep above)
def test_isolated_and_in_process_runs_give_the_same_cpu_peak(isolated_sweep):
    isolated = isolated_sweep[0][2]
    in_process = run_case(_case(), options=ONE_THREAD)
    assert isolated["isolated"] is True and in_process["isolated"] is False
    assert isolated["peak_mem_bytes"] == in_process["peak_mem_bytes"] > 0
    assert isolated["matches_baseline"] and isolated["cpu_threads"] == 1


def _flag_setters(register):
    @register
    class SetsBenchmark(CudnnBenchmark):
        """cudnn_benchmark's own session (sets the flag, restores it), allowed on the CPU for this test."""
        name = "test_sets_benchmark"
        devices = ("cpu", "cuda")

    @register
    class LeaksBenchmark(Strategy):
        """Sets the flag and never restores it: the runner's process-state guard must."""
        name = "test_leaks_benchmark"

        def session(self):
            torch.backends.cudnn.benchmark = True
            torch.set_num_threads(1)
            return super().session()

    return ["test_sets_benchmark", "test_leaks_benchmark"] + (
        ["cudnn_benchmark"] if torch.cuda.is_available() else [])  # the real one runs on CUDA only


def test_cudnn_benchmark_does_not_leak_into_the_next_case_without_isolation(temporary_strategy):
    seen = []

    @temporary_strategy
    class Probe(Strategy):
        """The baseline, noting the flag inside its step."""
        name = "test_probe"

        def forward(self):
            seen.append(torch.backends.cudnn.benchmark)
            return super().forward()

    setters = _flag_setters(temporary_strategy)
    assert torch.backends.cudnn.benchmark is False
    cases = [c for s in setters for c in (_case(s, batch_size=1), _case("test_probe", batch_size=1))]
    rows = run_cases(cases, options=RunOptions(isolate=False, threads=1))
    assert [r["status"] for r in rows] == ["ok"] * len(cases), [r["message"] for r in rows]
    assert seen and not any(seen)
    assert torch.backends.cudnn.benchmark is False


def test_process_state_restores_threads_and_determinism():
    threads = torch.get_num_threads()
    with process_state(threads=1, deterministic=True):
        assert torch.get_num_threads() == 1
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    assert torch.get_num_threads() == threads
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic


# --- repeats, noise, threads --------------------------------------------------------------------------------

def test_bootstrap_ci_is_deterministic_and_brackets_the_median():
    per_repeat = [[10.0, 11.0, 10.5], [12.0, 10.2], [9.9, 10.1, 30.0]]
    assert bootstrap_median_ci(per_repeat) == bootstrap_median_ci(per_repeat)
    s = summarize_timing(4, per_repeat)
    assert s["step_time_ms_ci95_low"] <= s["step_time_ms_median"] <= s["step_time_ms_ci95_high"]
    assert s["repeats"] == 3 and s["noisy"] is True
    steady = summarize_timing(4, [[10.0, 10.1, 10.05]] * 3)
    assert steady["noisy"] is False


def test_repeats_give_a_ci_identical_peaks_and_the_requested_threads():
    options = RunOptions(repeats=3, threads=1, deterministic=True)
    row = run_cases([_case(steps=2)], options=options)[0]
    assert row["status"] == "ok", row["message"]
    assert row["repeats"] == 3 and row["cpu_threads"] == 1 and row["deterministic"] is True
    assert row["step_time_ms_ci95_low"] <= row["step_time_ms_median"] <= row["step_time_ms_ci95_high"]
    assert row["peak_mem_spread_bytes"] == 0 and row["peak_mem_bytes"] > 0
    assert isinstance(row["noisy"], bool)
    assert not torch.are_deterministic_algorithms_enabled()
    table = format_table(results.to_frame([row]))
    ci = f"[{row['step_time_ms_ci95_low']:.1f}, {row['step_time_ms_ci95_high']:.1f}]"
    assert ci in table and "identical" in table
    assert ("~" in table) == row["noisy"]


def test_sweep_columns_follow_the_core_columns():
    assert results.COLUMNS[-len(results.SWEEP_COLUMNS):] == results.SWEEP_COLUMNS
    assert {"isolated", "repeats", "step_time_ms_ci95_low", "step_time_ms_ci95_high", "noisy",
            "peak_mem_spread_bytes", "deterministic"} <= set(results.COLUMNS)
