"""The results table: schema, relative columns and atomic writes."""

import math

import pandas as pd
import pytest

from bench.core import results


def _row(strategy, phase="train", peak=100, ms=10.0, status="ok"):
    return {"workload": "w", "strategy": strategy, "phase": phase, "device": "cpu", "batch_size": 4,
            "data": "synthetic", "peak_mem_bytes": peak, "step_time_ms_median": ms, "status": status}


def test_every_column_is_written_in_order(tmp_path):
    frame = results.write_rows([_row("baseline")], tmp_path / "r.csv")
    back = pd.read_csv(tmp_path / "r.csv")
    assert list(back.columns) == results.COLUMNS == list(frame.columns)


def test_units_live_in_column_names():
    measured = [c for c in results.COLUMNS if c.startswith(("peak_", "step_time"))]
    assert "peak_mem_bytes" in measured and "step_time_ms_median" in measured
    for column in measured:
        assert column.endswith("_bytes") or "_ms_" in column or column == "peak_stage", column


def test_relative_columns_use_the_matching_baseline():
    frame = results.to_frame([
        _row("baseline", peak=200, ms=10), _row("a", peak=100, ms=20),
        _row("baseline", phase="eval", peak=50, ms=5), _row("a", phase="eval", peak=25, ms=5),
        _row("b", status="unsupported", peak=None, ms=None),
    ])
    by = {(r.strategy, r.phase): r for r in frame.itertuples()}
    assert by["a", "train"].mem_vs_baseline == 0.5 and by["a", "train"].time_vs_baseline == 2.0
    assert by["a", "eval"].mem_vs_baseline == 0.5
    assert math.isnan(by["b", "train"].mem_vs_baseline)


def test_atomic_write_leaves_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "r.csv"
    results.write_rows([_row("baseline")], path)
    before = path.read_text()

    def broken_to_csv(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(pd.DataFrame, "to_csv", broken_to_csv)
    with pytest.raises(OSError):
        results.write_rows([_row("baseline"), _row("a")], path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["r.csv"]  # no temporary file left behind


def test_run_id_is_sortable_and_names_the_device():
    run_id = results.new_run_id("cuda")
    assert "-cuda-" in run_id and run_id[:8].isdigit()


def test_every_column_and_the_schema_version_are_documented():
    """A change of columns updates results/README.md: each column is named there, with the current version."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "results" / "README.md").read_text(encoding="utf-8")
    undocumented = [c for c in results.COLUMNS if f"`{c}`" not in readme]
    assert not undocumented, f"describe these columns in results/README.md: {undocumented}"
    assert f"schema_version {results.SCHEMA_VERSION})" in readme


def test_a_commit_that_looks_like_a_number_is_read_back_as_text(tmp_path):
    row = {**_row("baseline"), "git_commit": "50685e286372", "run_id": "20261122T085651Z-cpu-35de"}
    results.write_rows([row], tmp_path / "r.csv")
    assert results.read_results(tmp_path / "r.csv")["git_commit"].iloc[0] == "50685e286372"
