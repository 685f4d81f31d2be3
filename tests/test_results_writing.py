"""Where results are written and how: an unwritable --out or --resume refused before the first case, the run's lock
on its file, a full disk that leaves the file whole, a --resume through a symbolic link, the data cache's fallback,
and the timestamp of a row.

Tests run as root here, and root writes into a chmod 0o555 folder, so unwritable outputs are paths that cannot work
for anyone: an existing file where a folder is needed, and a path under a file.
"""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

from bench.core import progress, results
from bench.run import preflight
from bench.run.isolation import RunOptions
from bench.run.case import Case
from bench.run.runner import run_cases
from workloads.framework import captcha_data
from cli_helpers import REFERENCE_CSV, ROOT, TINY, cli as _cli, main_in_process as _main, one_line_exit_2 as _one_line_exit_2


def _a_run(tmp_path, strategies="baseline") -> Path:
    out = tmp_path / "run"
    done = _main("compare", "--strategies", strategies, *TINY, "--out", out)
    assert done.returncode == 0, done.stderr[-2000:]
    return next(out.glob("*.csv"))


def _file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("not a folder\n")
    return path


@pytest.mark.parametrize("command, where", [
    (["compare", "--strategies", "baseline", *TINY, "--out"], "file"),
    (["compare", "--strategies", "baseline", *TINY, "--out"], "under a file"),
    (["run", "--strategies", "baseline", *TINY, "--out"], "under a file"),
    (["predict", "--workload", "deep_mlp:layers=4:width=8", "--batch-size", "2", "--out"], "file"),
    (["fit", "--budget", "1MiB", "--workload", "deep_mlp:layers=4:width=8", "--max-batch", "4", "--out"], "file"),
    (["report", "--out"], "under a file"),
])
def test_an_unwritable_output_is_an_error_before_the_first_case(tmp_path, command, where):
    target = _file(tmp_path) if where == "file" else _file(tmp_path) / "sub"
    if command[0] == "report":
        csv = tmp_path / "run.csv"
        pd.read_csv(REFERENCE_CSV).head(3).to_csv(csv, index=False)
        command = ["report", str(csv), *command[1:]]
    started = time.monotonic()
    done = (_cli if command[0] == "compare" and where == "file" else _main)(*command, target)
    _one_line_exit_2(done, "--out", str(target))
    assert "[1/" not in done.stderr and "fit baseline:" not in done.stderr  # nothing ran
    assert time.monotonic() - started < 60


def test_a_resumed_file_that_cannot_be_written_is_an_error(tmp_path):
    done = _main("compare", "--strategies", "baseline", *TINY, "--resume", _file(tmp_path) / "run.csv")
    _one_line_exit_2(done, "--resume")


def test_a_second_run_on_the_same_file_refuses_while_the_first_holds_it(tmp_path):
    """The lock is the kernel's (flock), held by a live process: here this test's, in the way a first `--resume`
    holds it; the second `--resume` is a real process and refuses; after the holder ends, a resume works."""
    csv = _a_run(tmp_path, "baseline,del_intermediates")
    frame = results.read_results(csv)
    frame[frame["strategy"] == "baseline"].to_csv(csv, index=False)  # as if interrupted after the first case
    args = ["compare", "--strategies", "baseline,del_intermediates", *TINY, "--resume", csv]
    with preflight.RunLock(csv):
        _one_line_exit_2(_cli(*args), "another membench run", str(csv))
    done = _main(*args)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(results.read_results(csv)["strategy"]) == ["baseline", "del_intermediates"]
    assert not list(tmp_path.rglob(".*.lock"))


def test_an_unusable_data_cache_falls_back_to_a_temporary_folder_with_a_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEMBENCH_CACHE", str(_file(tmp_path) / "cache"))
    monkeypatch.setattr(captcha_data.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    made = []
    tensors = captcha_data.cached("probe.pt", lambda: made.append(1) or {"x": __import__("torch").ones(2)})
    assert tensors["x"].tolist() == [1.0, 1.0]
    assert "not usable" in capsys.readouterr().err
    assert (captcha_data.fallback_cache_dir() / "probe.pt").is_file()
    captcha_data.cached("probe.pt", lambda: made.append(2) or {})
    assert made == [1]  # the second call read the fallback


def test_the_timestamp_is_when_the_case_finished():
    """Results/README.md: `timestamp` is when the case finished. A case made to last over a second by a progress
    listener shows it: its timestamp is after the moment it started."""
    started = []

    def slow(what, done, total):
        time.sleep(1.1)

    case = Case("deep_mlp:layers=4:width=8", "baseline", "eval", 2, "cpu", warmup=0, steps=1)
    with progress.listening(slow):
        rows = run_cases([case], progress=lambda i, n, c, row: row is None and started.append(results.now_iso()),
                         options=RunOptions(threads=1))
    assert rows[0]["timestamp"] > started[0]
    assert "when the case finished" in (ROOT / "results" / "README.md").read_text(encoding="utf-8")


FILE_SIZE_LIMIT = textwrap.dedent('''
    """`python limit.py BYTES ARGS...`: `python -m bench ARGS...` under a file-size limit (as a full disk fails)."""
    import resource, runpy, sys
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    sys.argv = ["bench", *sys.argv[2:]]
    runpy.run_module("bench", run_name="__main__", alter_sys=True)
''')


def _under_size_limit(tmp_path, limit: int, *args) -> subprocess.CompletedProcess:
    script = tmp_path / "limit.py"
    script.write_text(FILE_SIZE_LIMIT, encoding="utf-8")
    return subprocess.run([sys.executable, str(script), str(limit), *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_a_full_disk_while_writing_the_results_says_the_file_is_whole_and_how_to_resume(tmp_path):
    """The resumed run's second row makes the file larger than the limit: one line, exit 1, that says the file is
    still valid (the write is atomic) and gives the exact `--resume` command; the file is byte for byte the same."""
    csv = _a_run(tmp_path)
    before = csv.read_bytes()
    args = ["compare", "--strategies", "baseline,del_intermediates", *TINY, "--resume", csv]
    done = _under_size_limit(tmp_path, len(before) + 50, *args)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    [line] = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert f"{csv} is still a valid results file" in line and "File too large" in line, line
    assert line.endswith(f"-m bench {' '.join(map(str, args))}"), line
    assert csv.read_bytes() == before
    assert sorted(p.name for p in csv.parent.iterdir()) == [csv.name]  # no temporary file left behind


def test_a_full_disk_at_the_first_write_says_nothing_was_written(tmp_path):
    done = _under_size_limit(tmp_path, 500, "compare", "--strategies", "baseline", *TINY, "--out", tmp_path / "out")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    [line] = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert "nothing was written" in line and "--resume" not in line, line
    assert not [p for p in (tmp_path / "out").iterdir() if p.suffix == ".csv" or p.name.endswith(".tmp")]


def test_resume_through_a_symbolic_link_writes_to_its_target_and_keeps_the_link(tmp_path):
    """The atomic rename would replace the link with a regular file: the run writes through to the link's target
    instead, and says so in one line ("Files")."""
    target = _a_run(tmp_path)
    frame = results.read_results(target)
    link = tmp_path / "latest.csv"
    link.symlink_to(target)
    done = _main("compare", "--strategies", "baseline,del_intermediates", *TINY, "--resume", link)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"--resume {link} is a symbolic link: writing to its target {target}" in done.stderr
    assert link.is_symlink() and link.resolve() == target
    assert sorted(results.read_results(target)["strategy"]) == ["baseline", "del_intermediates"]
    assert len(frame) == 1 and not list(target.parent.glob(".*.tmp"))

