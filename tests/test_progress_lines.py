"""What a run prints while it runs: how much it will run before it starts, the step within a case, fit's and
predict's progress, and a mismatch warned of only where there is one.
"""


import pytest

from bench.cli.console import Progress
from bench.core import progress
from bench.run.isolation import RunOptions
from bench.run.case import Case
from bench.run.runner import run_cases
from cli_helpers import TINY, cli_many, main_in_process as _main


def test_a_run_says_before_it_starts_how_much_it_runs_and_how_to_be_quick(tmp_path):
    done = _main("compare", "--strategies", "baseline", *TINY[:8], "--steps", "4", "--threads", "1",
                 "--no-isolate", "--out", tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    first = done.stderr.splitlines()[0]
    assert first.startswith("running 1 case(s)") and "3 warm-up + 4 measured" in first and str(tmp_path) in first
    # how long the first case takes (the quick form too, where that is over a minute: tests/test_adaptive_sweep.py)
    assert "the first case (" in done.stderr and "elapsed" in done.stderr


def test_progress_shows_the_step_within_a_case():
    class Terminal(list):
        def isatty(self):
            return True

        def write(self, text):
            self.append(text)

        def flush(self):
            pass

    screen = Terminal()
    bar = Progress(screen)
    case = Case("deep_mlp:layers=4:width=8", "baseline", "eval", 2, "cpu", warmup=1, steps=3)
    bar.case(0, 1, case, None)
    with progress.listening(bar.step):
        run_cases([case], options=RunOptions(threads=1))
    shown = "".join(screen)
    for text in ("verification", "warm-up", "timing step 1/3", "timing step 3/3", "memory"):
        assert text in shown, (text, shown)


@pytest.mark.slow  # in .ci/run's long tests of make test
def test_fit_and_predict_show_progress(tmp_path):
    # in a fresh process, whose first command is predict: a warning PyTorch gives once per process is not hidden
    # by an earlier test's
    predicted, done = cli_many(
        ["predict", "--workload", "deep_mlp:layers=4:width=8", "--batch-size", "2", "--strategies", "baseline,amp",
         "--out", tmp_path],
        ["fit", "--budget", "1MiB", "--workload", "deep_mlp:layers=4:width=8", "--max-batch", "16", "--phase", "eval",
         "--time-steps", "0", "--out", tmp_path])
    assert predicted.returncode == 0 and "[1/4] predicting baseline" in predicted.stderr, predicted.stderr[-2000:]
    assert "[4/4]" in predicted.stderr
    assert "GradScaler" not in predicted.stderr and "Warning" not in predicted.stderr  # no PyTorch warning without CUDA
    assert done.returncode == 0, done.stderr[-2000:]
    assert "fit baseline: tracked run" in done.stderr


@pytest.mark.parametrize("matches,warned", [(True, False), (False, True), (None, False)])
def test_the_progress_line_warns_of_a_mismatch_only(matches, warned):
    """An unverified row (matches_baseline empty: verification off, or fake tensors) is not a mismatch."""
    import io

    screen = io.StringIO()
    bar = Progress(screen)
    case = Case("deep_mlp:layers=4:width=8", "baseline", "eval", 2, "cpu")
    bar.case(0, 1, case, None)
    bar.case(0, 1, case, {"status": "ok", "peak_mem_bytes": 2**20, "step_time_ms_median": 1.0,
                          "measured_steps": 3, "timing_stop_reason": "fixed_steps", "matches_baseline": matches})
    assert ("DOES NOT MATCH BASELINE" in screen.getvalue()) is warned, screen.getvalue()

