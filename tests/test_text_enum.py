"""Statuses, roles and traits compare with a table's text whatever pandas keeps its strings in (Python objects or
Arrow), print as their text, and a run of `ok` rows is a successful command."""

import importlib.util

import pandas as pd
import pytest

from bench.cli.console import finish_run
from bench.core.results import Role, Status, to_frame
from workloads import Trait

STORAGES = ["python"] + (["pyarrow"] if importlib.util.find_spec("pyarrow") else [])


@pytest.mark.parametrize("storage", STORAGES)
def test_a_status_compares_with_a_string_column_of_any_storage(storage):
    column = pd.Series(["ok", "oom"], dtype=pd.StringDtype(storage, na_value=float("nan")))
    assert (column == Status.OK).tolist() == [True, False]
    assert (column != Status.OK).tolist() == [False, True]
    assert column.isin([Status.OOM]).tolist() == [False, True]


def test_members_are_their_text():
    for member in (Status.OK, Role.PITFALL, Trait.BATCH_NORM):
        assert str(member) == f"{member}" == member.value and f"{member:>12}" == f"{member.value:>12}"


@pytest.mark.parametrize("storage", STORAGES)
def test_a_run_of_ok_rows_is_a_successful_command(storage, tmp_path, monkeypatch):
    frame = to_frame([{"status": "ok", "strategy": "baseline"}, {"status": "ok", "strategy": "fsdp"}])
    frame["status"] = frame["status"].astype(pd.StringDtype(storage, na_value=float("nan")))
    monkeypatch.setattr("bench.cli.console.format_table", lambda frame: "")
    assert finish_run(frame, tmp_path / "run.csv") == 0
