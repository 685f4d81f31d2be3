"""Issue 31 §5, inputs nobody had tried: user code that leaks global state or exits, configuration files with wrong
types, numbers beyond range, the environment a job runs in, and messages that do not help. One test (or a
parametrized family) per instance found; the CLI runs in this process wherever a subprocess is not the point.
"""

import contextlib
import io
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import torch

from bench.run.isolation import RunOptions, STAGE_MARKER, _flags, crash_message
from bench.run.runner import Case, measure_case

ROOT = Path(__file__).resolve().parent.parent
HOSTILE = ROOT / "tests" / "fixtures" / "hostile_workload.py"
TINY = ["--phases", "train", "--batch-size", "2", "--device", "cpu", "--warmup", "0", "--steps", "1",
        "--threads", "1"]


def _main(*args):
    """The CLI in this process, as a CompletedProcess."""
    from bench.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def _one_line_exit_2(done, *names):
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    for name in names:
        assert name in done.stderr, (name, done.stderr)


def _tiny_case(mode: str) -> Case:
    return Case(f"{HOSTILE}:Tiny:mode={mode}", "baseline", "train", 2, "cpu", warmup=0, steps=1)


def _comparable(flags: dict) -> dict:
    return {key: value for key, value in flags.items() if key != "rng"}


# --- user code that leaks global state or exits ------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["dtype", "grad", "anomaly", "device", "threads", "deterministic"])
def test_a_workload_that_changes_global_state_does_not_change_the_next_case(mode):
    options = RunOptions(threads=1)
    clean = measure_case(_tiny_case("none"), options=options).row
    before = _flags()
    leaky = measure_case(_tiny_case(mode), options=options).row
    assert _comparable(_flags()) == _comparable(before)
    after = measure_case(_tiny_case("none"), options=options).row
    assert after["status"] == clean["status"] == "ok", (leaky, after)
    assert after["peak_mem_bytes"] == clean["peak_mem_bytes"]


def test_sys_exit_in_a_users_loss_is_an_error_row_and_the_cli_goes_on(tmp_path):
    done = _main("compare", "--strategies", "baseline", "--workload", f"{HOSTILE}:Tiny:mode=exit", *TINY,
                 "--no-isolate", "--out", tmp_path)
    assert done.returncode == 1, done.stderr
    row = pd.read_csv(next(tmp_path.glob("*.csv"))).iloc[0]
    assert row["status"] == "error" and "sys.exit(0)" in row["message"]


def test_os_exit_in_a_users_loss_under_isolate_is_an_error_row_not_the_end_of_the_cli(tmp_path):
    """The pre-flight (which runs the loss to calibrate) runs in a child under --isolate, so this process lives."""
    done = _main("compare", "--strategies", "baseline", "--workload", f"{HOSTILE}:Tiny:mode=os_exit", *TINY,
                 "--isolate", "--out", tmp_path)
    assert done.returncode == 1, done.stderr
    assert "pre-flight checks" in done.stderr
    row = pd.read_csv(next(tmp_path.glob("*.csv"))).iloc[0]
    assert row["status"] == "error" and "workload's code exited" in row["message"], row["message"]
    assert STAGE_MARKER.strip() not in row["message"]


def test_a_crashed_workers_row_shows_its_last_real_line_not_a_marker():
    stderr = f"{STAGE_MARKER}verification\nRuntimeError: boom\n{STAGE_MARKER}timing\n"
    assert crash_message(1, stderr) == "worker crashed (exit code 1): RuntimeError: boom"
    only_markers = crash_message(-9, f"{STAGE_MARKER}memory\n")
    assert STAGE_MARKER.strip() not in only_markers and "during memory" in only_markers
    assert "workload's code exited" in crash_message(0, f"{STAGE_MARKER}timing\n")


@pytest.mark.parametrize("name, error", [("broken_factory", "RuntimeError: the factory is broken"),
                                         ("BrokenInit", "ValueError: the init is broken")])
def test_a_workload_whose_factory_or_init_raises_is_one_line(name, error, tmp_path):
    done = _main("compare", "--strategies", "baseline", "--workload", f"{HOSTILE}:{name}", *TINY, "--out", tmp_path)
    _one_line_exit_2(done, name, error)
