"""The results table: schema, relative columns and atomic writes."""

import math

import pandas as pd
import pytest

from bench.core import check_tables, results


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


def _readme_sections() -> dict[str, str]:
    """results/README.md by `## ` heading: heading line -> the text under it, up to the next heading."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "results" / "README.md").read_text(encoding="utf-8")
    parts = readme.split("\n## ")[1:]
    return {part.split("\n", 1)[0]: part.split("\n", 1)[1] if "\n" in part else "" for part in parts}


@pytest.mark.parametrize("name", list(results.TABLES))
def test_every_column_and_the_schema_version_of_every_table_are_documented(name):
    """A change of a declared table's columns updates results/README.md: the table has a section headed with its
    current version (`## The fit table (schema_version 1)`), and each of its columns is named in that section."""
    table = results.TABLES[name]
    heading = f"The {table.name} table (schema_version {table.version})"
    sections = _readme_sections()
    assert heading in sections, f"results/README.md: no section `## {heading}` (a version bumped, a table added?)"
    undocumented = [c for c in table.names if f"`{c}`" not in sections[heading]]
    assert not undocumented, f"describe these columns of the {name} table in results/README.md: {undocumented}"


def test_the_results_table_is_the_one_with_the_results_version():
    assert results.TABLES["results"] is results.RESULTS and results.RESULTS.version == results.SCHEMA_VERSION
    assert results.RESULTS.names == results.COLUMNS


@pytest.mark.parametrize("name", [n for n in results.TABLES if n != "results"])
def test_another_table_is_written_in_its_declared_order_with_its_version_and_kinds(name, tmp_path):
    table = results.TABLES[name]
    values = {"int": 1234, "float": 1.5, "bool": True, "text": "x"}
    full = table.row({c.name: values[c.kind] for c in table.columns if c.name != "schema_version"})
    empty = table.row()  # every figure missing: ints stay ints, not 1234.0
    results.write_table(table, [full, empty], tmp_path / "t.csv")
    lines = (tmp_path / "t.csv").read_text().splitlines()
    assert lines[0].split(",") == table.names
    back = pd.read_csv(tmp_path / "t.csv")
    assert (back["schema_version"] == table.version).all()
    for column in table.names_of("int"):
        if column != "schema_version":
            assert "1234.0" not in lines[1] and back[column].iloc[0] == 1234 and pd.isna(back[column].iloc[1])


@pytest.mark.parametrize("name", [n for n in results.TABLES if n != "results"])
def test_a_row_of_another_table_refuses_an_undeclared_column(name, tmp_path):
    from bench.core.schema import UndeclaredColumn

    table = results.TABLES[name]
    with pytest.raises(UndeclaredColumn, match="not a column of the"):
        table.row(peak_mem_bytes_typo=1)
    with pytest.raises(UndeclaredColumn):  # a plain dict handed to the writer is checked too
        results.write_table(table, [{"no_such_column": 1}], tmp_path / "t.csv")
    assert not (tmp_path / "t.csv").exists()


def test_the_columns_that_tell_the_other_tables_apart_are_theirs_alone():
    """`report` and `--resume` name a predict or fit table by a column only that table has (OTHER_TABLES)."""
    assert "predicted_bytes" in results.PREDICT.names and "budget_bytes" in results.FIT.names
    for column in ("predicted_bytes", "budget_bytes"):
        assert column not in results.COLUMNS


def test_each_table_versions_itself():
    """Each table has its own version constant, and a file of one table says that table's number."""
    assert results.PREDICT.version == results.PREDICT_SCHEMA_VERSION
    assert results.FIT.version == results.FIT_SCHEMA_VERSION
    assert check_tables.PREDICTION_CHECK.version == check_tables.PREDICTION_CHECK_SCHEMA_VERSION
    assert {table.name for table in results.TABLES.values()} == set(results.TABLES)
    for table in results.TABLES.values():
        assert table.row()["schema_version"] == table.version


def test_a_commit_that_looks_like_a_number_is_read_back_as_text(tmp_path):
    row = {**_row("baseline"), "git_commit": "50685e286372", "run_id": "20261122T085651Z-cpu-35de"}
    results.write_rows([row], tmp_path / "r.csv")
    assert results.read_results(tmp_path / "r.csv")["git_commit"].iloc[0] == "50685e286372"
