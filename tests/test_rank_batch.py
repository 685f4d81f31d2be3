"""`--batch-size` under `--ranks N` is each rank's batch, as torchrun's ranks each load their own (the step's batch
is N times it); `--global-batch-size` gives the step's batch instead, split across the ranks. Cases and rows carry
the step's batch, which sharding splits and the one-process baseline trains on."""

from __future__ import annotations

import csv

import pytest

from bench.cli import commands_run
from bench.cli.analysis_console import batch_words, compare_command
from bench.cli.arguments import batch_option_of
from bench.cli.main import main
from bench.core.errors import UsageError

WORKLOAD = "deep_mlp:layers=4:width=8"


def _predicted_batches(tmp_path, *argv) -> list[tuple[str, int]]:
    code = main(["predict", "--workload", WORKLOAD, "--device", "cpu", "--phases", "train", "--strategies", "baseline,ddp",
                 "--out", str(tmp_path), *argv])
    assert code == 0
    (path,) = tmp_path.glob("predict-*.csv")
    with path.open() as handle:
        return [(row["strategy"], int(row["batch_size"])) for row in csv.DictReader(handle)]


def test_predict_takes_the_batch_of_each_rank(tmp_path, capsys):
    assert _predicted_batches(tmp_path, "--ranks", "2", "--batch-size", "3") == [("baseline", 6), ("ddp", 6)]
    assert "batch: the step's, over 2 ranks (6: 3 a rank)" in capsys.readouterr().out


def test_predict_takes_a_global_batch_split_unevenly(tmp_path, capsys):
    assert _predicted_batches(tmp_path, "--ranks", "2", "--global-batch-size", "3") == [("baseline", 3), ("ddp", 3)]
    assert "(3: 2 or 1 a rank)" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["predict"], ["plan", "--budget", "1GiB", "--device", "cpu"]])
def test_both_batch_options_are_one_line_and_exit_2(command, capsys):
    code = main([*command, "--workload", WORKLOAD, "--ranks", "2", "--batch-size", "1", "--global-batch-size", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "--batch-size 1" in err and "--global-batch-size 2" in err and "not both" in err


@pytest.mark.parametrize("argv, batches", [
    (["--batch-size", "1,2"], [2, 4]),
    (["--global-batch-size", "3"], [3]),
])
def test_compare_makes_its_cases_with_the_steps_batch(argv, batches, monkeypatch, tmp_path, capsys):
    made = []

    def stop(cases, bind):
        made.extend(cases)
        raise UsageError("stopped before running")

    monkeypatch.setattr(commands_run.preflight, "check_cases", stop)
    code = main(["compare", "--workload", WORKLOAD, "--device", "cpu", "--ranks", "2", "--strategies", "ddp",
                 "--phases", "train", "--out", str(tmp_path), *argv])
    assert code == 2 and "stopped before running" in capsys.readouterr().err
    assert sorted({case.batch_size for case in made}) == batches


def test_the_printed_commands_ask_for_the_same_step():
    assert batch_option_of(8, 8) == "--batch-size 1"
    assert batch_option_of(8, 5) == "--global-batch-size 8"
    assert batch_option_of(100, 1) == "--batch-size 100"
    assert batch_words(8, 5) == "batch 8 (2 or 1 a rank on 5 ranks)" and batch_words(4, 1) == "batch 4"

    class Request:
        workload, batch_size, ranks, device = WORKLOAD, 6, 3, "cpu"

    assert "--batch-size 2 " in compare_command(Request, "ddp") and "--ranks 3" in compare_command(Request, "ddp")
