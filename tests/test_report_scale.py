"""A report's work is bounded whatever the CSVs hold (a 100,000-row file drew for minutes): at most MAX_GROUPS
groups, MAX_BATCH_SIZES batch sizes and MAX_STRATEGIES strategies a group are drawn, and the report says what it left
out; a report stopped by a signal leaves no temporary chart behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

from bench.report import data, markdown
from bench.report.markdown import build_report
from cli_helpers import REFERENCE_CSV, ROOT

# the reference run: 8 strategies x 2 phases x 2 batch sizes (25, 100)
REFERENCE = pd.read_csv(REFERENCE_CSV)


def _copies(count: int, change) -> pd.DataFrame:
    """`count` copies of the reference run's rows, copy i changed by `change(frame, i)`."""
    frames = []
    for i in range(count):
        frame = REFERENCE.copy()
        change(frame, i)
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def _write(frame: pd.DataFrame, folder: Path) -> Path:
    path = folder / "20260101T000000Z-cpu-big.csv"
    frame.to_csv(path, index=False)
    return path


def test_a_run_of_many_batch_sizes_shows_twelve_spread_over_them_and_says_so(tmp_path):
    frame = _copies(30, lambda f, i: f.__setitem__("batch_size", f["batch_size"] + 1000 * i))  # 60 batch sizes
    report = build_report([_write(frame, tmp_path)], tmp_path).read_text()
    header = next(line for line in report.splitlines() if line.startswith("| strategy | batch "))
    shown = [int(cell.split()[1]) for cell in header.strip("| ").split(" | ")[1:]]
    every = sorted(frame["batch_size"].unique())
    assert len(shown) == data.MAX_BATCH_SIZES and shown[0] == every[0] and shown[-1] == every[-1]
    assert 100 in shown  # the charted batch
    assert f"{data.MAX_BATCH_SIZES} of the 60 batch sizes" in report
    [chart] = tmp_path.glob("*.batch.png")
    assert chart.stat().st_size > 0


def test_a_run_of_many_strategies_shows_the_first_ones_and_says_so(tmp_path, monkeypatch):
    for module in (data, markdown):  # the same code as at 40 strategies, with fewer bars to draw
        monkeypatch.setattr(module, "MAX_STRATEGIES", 10)
    frame = _copies(2, lambda f, i: f.__setitem__("strategy", [s if i == 0 else f"{s}+copy" for s in f["strategy"]]))
    frame = frame[frame["batch_size"] == 100]
    report = build_report([_write(frame, tmp_path)], tmp_path).read_text()
    assert "6 more strategies are not shown" in report and "the first 10 of a run" in report  # 16 strategies
    order = data.strategy_order(frame)  # baseline, techniques, compositions: the first 10 are shown
    assert f"`{order[9]}`" in report and f"`{order[10]}`" not in report and f"`{order[-1]}`" not in report


def test_past_the_most_groups_the_rest_are_named_not_drawn(tmp_path, monkeypatch):
    monkeypatch.setattr(markdown, "MAX_GROUPS", 2)  # the same code as at 20 groups, in a tenth of the time
    frame = _copies(5, lambda f, i: f.__setitem__("workload", f"{f['workload'][0]}_{i}"))
    frame = frame[frame["batch_size"] == 100]  # no batch chart: fewer charts to draw
    report = build_report([_write(frame, tmp_path)], tmp_path).read_text()
    assert report.count("### Environment") == 2
    assert "3 more groups (runs, devices, workloads or data sources; 1 run ids) are not drawn" in report
    drawn = {path.name.split(".")[1] for path in tmp_path.glob("*.png")}
    assert drawn == {f"{REFERENCE['workload'][0]}_{i}" for i in range(2)}


@pytest.mark.slow
def test_a_hundred_thousand_rows_report_within_a_minute(tmp_path):
    """The issue's file: 100,000 rows of one run over 3,125 batch sizes (it had not finished after two minutes)."""
    frame = _copies(3125, lambda f, i: f.__setitem__("batch_size", f["batch_size"] + 1000 * i))
    path = _write(frame, tmp_path)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "bench", "report", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert time.monotonic() - started < 60


# `python -m bench report ...` whose first chart, half-written, gets SIGTERM (what `timeout` sends)
STOPPED_MID_CHART = textwrap.dedent('''
    import os, runpy, signal, sys, time
    from matplotlib.figure import Figure

    def savefig(self, target, **kwargs):
        with open(target, "wb") as f:
            f.write(b"\\x89PNG half")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)

    Figure.savefig = savefig
    sys.argv = ["bench", *sys.argv[1:]]
    runpy.run_module("bench", run_name="__main__", alter_sys=True)
''')


def test_a_report_stopped_by_sigterm_leaves_no_temporary_chart(tmp_path):
    script = tmp_path / "stopped.py"
    script.write_text(STOPPED_MID_CHART)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(script), "report", str(REFERENCE_CSV), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == []  # no chart, no `.*.png.*.tmp`
