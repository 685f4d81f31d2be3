"""A results folder from someone else, and where membench's files land: reading snapshots runs no code and never
blocks on a FIFO; a symlinked `<run>.snapshots` is not written through; a workload that changes the working
directory does not move a relative --out; a long workload spec makes no file name over the file system's limit."""

from __future__ import annotations

import os
import pickle
import threading
from pathlib import Path

import numpy as np
import pytest

from bench.cli.main import main
from bench.core.filenames import FILE_SYSTEM_LIMIT_BYTES, bounded_name
from bench.core.snapshots import NotASnapshotFileError, UnsafeSnapshotError, read_snapshot
from bench.measure.snapshot import file_name, write_snapshot
from bench.report import charts
from bench.report.data import Group, report_name

WANDERING = '''
import os
import torch
from torch import nn
from workloads import Workload


class Wander(Workload):
    """A workload whose code changes the working directory (as some training scripts do)."""
    default_batch_size = 2

    def build_model(self):
        os.makedirs(os.environ["WANDER_TO"], exist_ok=True)
        os.chdir(os.environ["WANDER_TO"])
        return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))

    def make_batch(self, batch_size, data="synthetic"):
        gen = torch.Generator().manual_seed(self.seed)
        return torch.rand(batch_size, 3, generator=gen), torch.rand(batch_size, 2, generator=gen)

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)
'''


class RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _within(seconds: float, function, *args):
    """`function(*args)`'s result, or a failure where it has not returned in `seconds` (a FIFO read blocks)."""
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(result=_call(function, *args)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert "result" in box, f"{function.__name__} blocked for {seconds} s"
    return box["result"]


def _call(function, *args):
    try:
        return function(*args)
    except Exception as error:  # noqa: BLE001 - the caller judges the error
        return error


def test_reading_a_snapshot_runs_no_code_and_never_blocks(tmp_path):
    crafted = tmp_path / "crafted.pickle"
    crafted.write_bytes(pickle.dumps({"device_traces": [], "membench": RunsCode(tmp_path / "pwned")}))
    error = _within(10, read_snapshot, crafted)
    assert isinstance(error, UnsafeSnapshotError) and "posix.system" in str(error), error
    assert not (tmp_path / "pwned").exists()
    os.mkfifo(tmp_path / "fifo.pickle")  # nobody writes it: opening it to read would wait for ever
    assert isinstance(_within(10, read_snapshot, tmp_path / "fifo.pickle"), NotASnapshotFileError)
    # what membench writes reads back: numpy numbers, paths and tuples made plain, the format PyTorch's
    path = write_snapshot({"segments": [{"segment_pool_id": (0, 0), "total_size": np.int64(512)}],
                           "device_traces": [[]], "membench": {"workload": "w", "file": tmp_path, "rank": None,
                                                               "batch_size": np.int64(2)}}, tmp_path / "out")
    snapshot = read_snapshot(path)
    assert snapshot["segments"][0] == {"segment_pool_id": (0, 0), "total_size": 512}
    assert snapshot["membench"]["file"] == str(tmp_path) and type(snapshot["membench"]["batch_size"]) is int


def test_a_symlinked_snapshot_folder_is_not_written_through_on_resume(tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    results = tmp_path / "20260101T000000Z-cpu-abcd.csv"
    results.write_text("run_id\n")
    (tmp_path / "20260101T000000Z-cpu-abcd.snapshots").symlink_to(elsewhere)
    code = main(["compare", "--workload", "deep_mlp:layers=2:width=4", "--strategies", "checkpoint", "--device",
                 "cpu", "--batch-size", "2", "--quick", "--snapshot", "--resume", str(results)])
    err = capsys.readouterr().err
    assert code == 2 and "is a symbolic link" in err and len(err.strip().splitlines()) == 1, err
    assert list(elsewhere.iterdir()) == []


@pytest.mark.slow  # in .ci/run's long tests of make test
def test_a_workload_that_changes_directory_does_not_move_a_relative_out(tmp_path, monkeypatch):
    (tmp_path / "wander.py").write_text(WANDERING)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDER_TO", str(tmp_path / "elsewhere"))
    assert main(["compare", "--workload", "wander.py:Wander", "--strategies", "checkpoint", "--device", "cpu",
                 "--batch-size", "2", "--quick", "--threads", "1", "--snapshot", "--out", "out"]) == 0
    [csv] = [p for p in (tmp_path / "out").glob("*.csv") if not p.name.endswith(".timeline.csv")]
    assert list((tmp_path / "out").glob("*.snapshots/*.pickle"))
    assert not (tmp_path / "elsewhere" / "out").exists()


def test_a_long_workload_spec_makes_file_names_within_the_limit(tmp_path):
    spec = "mine.py:Model:" + ":".join(f"option_{i}=value_{i}" for i in range(40))  # about 700 bytes
    about = {"workload": spec, "strategy": "checkpoint+amp", "phase": "train", "batch_size": 4, "device": "cpu",
             "rank": 3}
    name = file_name(about)
    assert len(name.encode()) <= FILE_SYSTEM_LIMIT_BYTES - 24 and name.endswith(".pickle")
    assert name.startswith("mine.py_Model_option_0=value_0")  # still says what it is
    assert file_name({**about, "workload": spec + "x"}) != name  # two specs, two files
    path = write_snapshot({"segments": [], "device_traces": [[]], "membench": about}, tmp_path)
    assert path.exists() and read_snapshot(path)["membench"]["workload"] == spec
    group = Group("run", "cpu", spec, "synthetic", None, suffix="." + spec.replace(":", "_"))
    assert len(charts.chart_path(group, tmp_path, "memory").name.encode()) <= FILE_SYSTEM_LIMIT_BYTES - 24
    assert len(report_name([Path(f"{spec}-{i}.csv") for i in range(3)], ".html").encode()) <= 255
    assert bounded_name("short", ".png") == "short.png"
