"""A full disk while a case's results are written, then `--resume`: the step timeline beside the results holds
every case's points once, whichever of the two files the disk refused (the case was being written to both)."""

import errno

import pandas as pd
import pytest

from bench.core.atomic import WriteFailed
from bench.run import runner
from bench.run.isolation import RunOptions
from bench.run.resume import load_resume
from bench.run.case import Case
from bench.run.runner import run_cases

CASES = [Case("deep_mlp:layers=4:width=8", strategy, "train", 2, "cpu", warmup=0, steps=1)
         for strategy in ("baseline", "del_intermediates")]


def _full_disk_at(monkeypatch, module_name: str, call: int) -> None:
    """The `call`-th call of `runner.<module_name>` (the timeline's or the results' writer) fails as a full disk."""
    real, calls = getattr(runner, module_name), []

    def write(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise WriteFailed(args[-1] if len(args) > 1 else kwargs.get("path"),
                              OSError(errno.ENOSPC, "No space left on device"))
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, module_name, write)


def _timeline_cases(csv) -> list[str]:
    timeline = pd.read_csv(csv.with_suffix(".timeline.csv"))
    return sorted(timeline.drop_duplicates(["strategy", "index"]).groupby("strategy").size().items())


@pytest.fixture(scope="module")
def clean_timeline(tmp_path_factory) -> list:
    """The points per case of a run that no full disk stopped."""
    clean = tmp_path_factory.mktemp("clean") / "20260101T000000Z-cpu-clean.csv"
    run_cases(CASES, clean, options=RunOptions(threads=1))
    return _timeline_cases(clean)


# the second case's first write: the timeline's (it is written first), or the results' (the timeline then has it)
@pytest.mark.parametrize("writer", ["write_csv_atomic", "write_rows"])
def test_the_timeline_has_every_case_once_after_a_full_disk_and_resume(tmp_path, monkeypatch, writer,
                                                                        clean_timeline):
    csv = tmp_path / "20260101T000000Z-cpu-test.csv"
    options = RunOptions(threads=1)

    with monkeypatch.context() as patched:
        _full_disk_at(patched, writer, call=2)
        with pytest.raises(WriteFailed):
            run_cases(CASES, csv, options=options)
    resumed = load_resume(csv, CASES, options)
    assert [case.strategy for case in resumed.remaining] == ["del_intermediates"]  # not in the results: runs again
    run_cases(resumed.remaining, csv, options=options, previous_rows=resumed.rows, run_id=resumed.run_id)

    assert _timeline_cases(csv) == clean_timeline
    assert [name for name, _ in clean_timeline] == ["baseline", "del_intermediates"]
