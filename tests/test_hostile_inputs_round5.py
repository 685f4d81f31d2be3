"""Round five of hostile input: values accepted that should be refused (or refused naming the wrong
thing), figures wrong without a word, and tracebacks where one line is due, on the newer surfaces (seq_len search,
--capability, --ranks, the environment, --resume, report over the newer tables, the Python API, the example run from
elsewhere). One test (or a parametrized family) per class; the CLI runs in this process where a process of its own is
not the point, and every refusal comes before any case is run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

import membench
from bench.core import job_environment, results
from bench.core.errors import UsageError
from bench.measure import resident
from cli_helpers import REFERENCE_CSV, TINY, cli as _cli, main_in_process as _main, one_line_exit_2 as _one_line_exit_2

ROOT = Path(__file__).resolve().parent.parent
MLP = "deep_mlp:layers=2:width=8"
LLAMA = "hf:tiny-llama"  # max_position_embeddings 128


def _nothing_written(folder: Path) -> bool:
    return not folder.exists() or not list(folder.glob("*.csv"))


# --- §1 input accepted that should be refused ------------------------------------------------------------------------

@pytest.mark.parametrize("args, option", [
    (["predict", "--strategies", ""], "--strategies"),
    (["predict", "--phases", " , "], "--phases"),
    (["predict", "--batch-size", ""], "--batch-size"),
    (["compare", "--strategies", "baseline", "--workload", ""], "--workload"),
    (["compare", "--strategies", "baseline", "--phases", ""], "--phases"),
    (["run", "--suite", "bench/suites/default.yaml", "--strategies", " , "], "--strategies"),
    (["fit", "--budget", "1MiB", "--strategies", ","], "--strategies"),
    (["plan", "--budget", "1MiB", "--strategies", " , "], "--strategies"),
    (["anchors", "--only", ""], "--only"),
])
def test_an_empty_list_option_is_refused_not_read_as_its_default(tmp_path, args, option):
    """Before: `--phases ""` ran every phase, `--workload ""` the default workload, `plan --strategies " , "` every
    strategy the planner tries, `anchors --only ""` every anchor, all with exit 0."""
    done = _main(*args, "--out", tmp_path / "out")
    _one_line_exit_2(done, option, "empty value")
    assert _nothing_written(tmp_path / "out")


@pytest.mark.parametrize("args, names", [
    # a step longer than the model takes: refused naming the option, not the probe `hf:tiny-llama:seq_len=256`
    (["fit", "--over", "seq_len", "--budget", "1GiB", "--seq-step", "256"], ["--seq-step 256", "128"]),
    # a bound below the step: answered 32 tokens, over the user's own bound, "capped by the longest sequence, 20"
    (["fit", "--over", "seq_len", "--budget", "1GiB", "--seq-step", "32", "--max-seq-len", "20"],
     ["--seq-step 32", "--max-seq-len 20"]),
    # a bound beyond the model's: refused after a first prediction, naming the probe `seq_len=992`
    (["plan", "--over", "seq_len", "--budget", "1GiB", "--seq-step", "32", "--max-seq-len", "1000"],
     ["--max-seq-len 1,000", "128", "max_position_embeddings"]),
    (["fit", "--over", "seq_len", "--budget", "1GiB", "--seq-step", "32", "--max-seq-len", "1000"],
     ["--max-seq-len 1,000", "128"]),
])
def test_a_sequence_bound_that_conflicts_is_refused_naming_the_option(tmp_path, args, names):
    done = _main(*args, "--workload", LLAMA, "--device", "cpu", "--jobs", "1", "--out", tmp_path / "out")
    _one_line_exit_2(done, *names)
    assert "seq_len=" not in done.stderr and "[1/" not in done.stderr and _nothing_written(tmp_path / "out")


@pytest.mark.parametrize("args, names", [
    (["predict", "--device", "cuda", "--capability", "99.9"], ["--capability", "99.9", "9.0"]),
    (["predict", "--device", "cuda", "--capability", "0.0"], ["--capability", "0.0"]),
    (["predict", "--device", "cpu", "--capability", "9.0"], ["--capability 9.0", "cpu"]),
    # --ranks with strategies that shard nothing: each case was one device's step of the ranks' whole batch
    (["predict", "--device", "cpu", "--ranks", "4", "--strategies", "checkpoint"], ["--ranks 4", "ddp", "fsdp"]),
    (["plan", "--budget", "1MiB", "--ranks", "4", "--strategies", "checkpoint"], ["--ranks 4", "ddp"]),
    (["plan", "--budget", "1MiB", "--max-ranks", "4", "--strategies", "amp"], ["--max-ranks 4", "ddp"]),
    (["compare", "--strategies", "checkpoint", "--ranks", "2", *TINY[2:]], ["--ranks 2", "ddp"]),
])
def test_a_capability_no_gpu_has_and_ranks_that_shard_nothing_are_refused(tmp_path, args, names):
    done = _main(*args, "--workload", MLP, "--out", tmp_path / "out")
    _one_line_exit_2(done, *names)
    assert _nothing_written(tmp_path / "out")


def test_the_capability_parser_takes_every_real_capability():
    from bench.core.gpus import COMPUTE_CAPABILITIES, GPUS, parse_capability

    assert all(gpu.capability in COMPUTE_CAPABILITIES for gpu in GPUS.values())
    assert parse_capability("8.6") == parse_capability((8, 6)) == parse_capability(8.6) == (8, 6)
    for bad in ("9", "9.00", "9.0.1", "-9.0", (9, 0, 1), (9.0, 0), True):
        with pytest.raises(UsageError, match="capability"):
            parse_capability(bad)


@pytest.mark.parametrize("variable, value, words", [
    ("MEMBENCH_MMAP_THRESHOLD", "-5", ["MEMBENCH_MMAP_THRESHOLD='-5'", "off"]),  # was taken as `off`
    ("MEMBENCH_MMAP_THRESHOLD", "lots", ["MEMBENCH_MMAP_THRESHOLD='lots'"]),
    ("MEMBENCH_ANCHOR_WORKER_BYTES", "-1", ["MEMBENCH_ANCHOR_WORKER_BYTES='-1'"]),  # was RLIM_INFINITY: no cap
    ("MEMBENCH_ANCHOR_WORKER_BYTES", "lots", ["MEMBENCH_ANCHOR_WORKER_BYTES='lots'"]),
    ("MEMBENCH_FAKE_CUDA_WORKER", "1", ["MEMBENCH_FAKE_CUDA_WORKER", "unset"]),  # a traceback on the first import
])
def test_a_meaningless_environment_variable_is_one_line_before_anything_runs(monkeypatch, variable, value, words):
    monkeypatch.setenv(variable, value)
    with pytest.raises(UsageError) as raised:
        job_environment.check_job_environment("predict")
    assert all(word in str(raised.value) for word in words), raised.value


def test_the_environment_readers_take_blank_as_unset_and_sizes_as_sizes(monkeypatch):
    from workloads.framework import captcha_data

    monkeypatch.setenv("MEMBENCH_CACHE", "  ")  # was Path(""): the data set generated into the working folder
    assert captcha_data.cache_dir() == Path.home() / ".cache" / "membench"
    monkeypatch.setenv(resident.THRESHOLD_VARIABLE, "256KiB")
    assert resident.mmap_threshold_setting() == 256 * 1024
    monkeypatch.setenv(resident.THRESHOLD_VARIABLE, "off")
    assert resident.mmap_threshold_setting() is None
    monkeypatch.setenv(job_environment.ANCHOR_WORKER_BYTES_VARIABLE, "2GiB")
    from bench.analysis import anchors

    assert anchors.worker_memory_bytes() == 2 * 2**30


def test_resume_of_another_workloads_file_is_refused(tmp_path):
    """Before: the second workload's rows were appended to the first's file under the first run's id."""
    out = tmp_path / "out"
    assert _main("compare", "--strategies", "baseline", *TINY, "--out", out).returncode == 0
    (path,) = [p for p in out.glob("*.csv") if not p.name.endswith(".timeline.csv")]
    before = path.read_bytes()
    other = ["--workload", "deep_mlp:layers=3:width=8", *TINY[2:]]
    done = _main("compare", "--strategies", "baseline", *other, "--resume", path)
    _one_line_exit_2(done, "cannot resume", "deep_mlp:layers=4:width=8", "--workload")
    assert path.read_bytes() == before


@pytest.mark.parametrize("kind", ["results", "predict"])
def test_report_warns_of_a_file_from_a_newer_membench(tmp_path, kind):
    if kind == "results":
        source, table, html = REFERENCE_CSV, results.RESULTS, []
    else:
        assert _main("predict", "--workload", MLP, "--device", "cpu", "--phases", "train", "--batch-size", "2",
                     "--out", tmp_path / "predicted").returncode == 0
        (source,), table, html = list((tmp_path / "predicted").glob("predict-*.csv")), results.PREDICT, ["--html"]
    frame = pd.read_csv(source, dtype=str)
    frame["schema_version"] = str(table.version + 1)
    path = tmp_path / (source.name if kind == "predict" else "20261128T000000Z-cpu-aaaa.csv")
    frame.to_csv(path, index=False)
    done = _main("report", path, *html, "--out", tmp_path / "report")
    assert done.returncode == 0, done.stderr
    warning = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and f"schema_version {table.version + 1}" in warning[0], done.stderr


def _edited(tmp_path, column: str, value: str, row: int = 0) -> Path:
    frame = pd.read_csv(REFERENCE_CSV, dtype=str)
    frame.loc[row, column] = value
    path = tmp_path / f"20261128T000000Z-cpu-{abs(hash((column, value))) % 10**4:04d}.csv"
    frame.to_csv(path, index=False)
    return path


@pytest.mark.parametrize("column, value, words", [
    ("peak_mem_bytes", "1e400", ["'1e400'", "overflows"]),  # was quoted back as 'inf'
    ("step_time_ms_median", "1e400", ["'1e400'", "overflows"]),  # was drawn as infinitely slow
    ("peak_mem_bytes", "-5000000", ["'-5000000'", "negative"]),  # §2: drawn as if real
    ("step_time_ms_median", "-3.5", ["'-3.5'", "negative"]),
    ("peak_reserved_bytes", "-1", ["'-1'", "negative"]),
])
def test_a_cell_is_quoted_as_written_and_a_negative_figure_refused(tmp_path, column, value, words):
    path = _edited(tmp_path, column, value, row=1)
    with pytest.raises(UsageError) as raised:
        results.read_results_file(path, "cannot report on", results.REPORT_COLUMNS)
    assert all(word in str(raised.value) for word in words) and f"column {column!r}" in str(raised.value)
    assert "row 2 (line 3)" in str(raised.value)


def test_what_membench_writes_itself_still_reads():
    """`inf` as membench writes it (output_rel_diff against a baseline of 0) and a negative harness share are
    values, not mistakes: every committed reference run reads."""
    from bench.report.data import is_derived

    runs = [p for p in (ROOT / "results").rglob("*.csv") if not is_derived(p)
            and set(results.REPORT_COLUMNS) <= set(columns := pd.read_csv(p, nrows=0).columns)
            and not set(results.OTHER_TABLES) & set(columns)]
    assert len(runs) >= 5 and all(len(results.read_results_file(p, "x", results.REPORT_COLUMNS)) for p in runs)


# --- §2 a number that is wrong, with nothing said --------------------------------------------------------------------

def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


BATCH = (torch.randn(4, 8), torch.randint(3, (4,)))
LOSS = torch.nn.functional.cross_entropy


def test_the_api_takes_a_capability_as_the_command_line_spells_it():
    """`capability="9.0"` was ignored (the default GPU's cuBLAS workspace); it is (9, 0), as `--capability 9.0`."""
    spelled = membench.estimate(_mlp, BATCH, LOSS, device="cuda", capability="9.0", engine="fake", name="cap_text")
    pair = membench.estimate(_mlp, BATCH, LOSS, device="cuda", capability=(9, 0), engine="fake", name="cap_pair")
    default = membench.estimate(_mlp, BATCH, LOSS, device="cuda", engine="fake", name="cap_none")
    assert spelled.row["cublas_workspace_bytes"] == pair.row["cublas_workspace_bytes"]
    assert spelled.row["cublas_workspace_bytes"] != default.row["cublas_workspace_bytes"]


@pytest.mark.parametrize("call, named", [
    (lambda: membench.estimate(_mlp, BATCH, LOSS, device="cuda", capability=(99, 9)), "capability:"),
    (lambda: membench.estimate(_mlp, BATCH, LOSS, device="cuda", capability="abc"), "capability:"),
    (lambda: membench.estimate(_mlp, BATCH, LOSS, capability="9.0"), "capability"),  # on the CPU: no such thing
    (lambda: membench.estimate(_mlp, BATCH, LOSS, batch_size=0), "batch_size:"),  # was the workload's own batch
    (lambda: membench.estimate(_mlp, BATCH, LOSS, batch_size=2.5), "batch_size:"),  # was batch 2
    (lambda: membench.estimate(_mlp, BATCH, LOSS, gpu="nope"), "gpu:"),  # was a UsageError, no ValueError
    (lambda: membench.estimate(_mlp, BATCH, LOSS, strategies="nope"), "strategies:"),
    (lambda: membench.estimate(_mlp, BATCH, LOSS, strategies=[]), "strategies:"),  # was [] and no word
    (lambda: membench.estimate(_mlp, BATCH, LOSS, engine="gpu"), "engine:"),  # was an `error` row
    (lambda: membench.estimate(_mlp, BATCH, LOSS, snapshot_dir="/etc/passwd"), "snapshot_dir"),  # FileExistsError
    (lambda: membench.plan(_mlp, BATCH, LOSS, gpu="nope"), "gpu:"),
    (lambda: membench.plan(_mlp, BATCH, LOSS, budget="1MiB", max_candidates=0), "max_candidates:"),  # "nothing fits"
    (lambda: membench.plan(_mlp, BATCH, LOSS, budget="1MiB", max_search_s=-1), "max_search_s:"),
    (lambda: membench.fit(_mlp, BATCH, LOSS, budget="1MiB", max_batch=0), "max_batch:"),  # answered batch 0
    (lambda: membench.fit(_mlp, BATCH, LOSS, budget="1MiB", time_steps=-1), "time_steps:"),
    (lambda: membench.fit(_mlp, BATCH, LOSS, budget="1MiB", strategies=["nope"]), "strategies:"),
    (lambda: membench.measure(_mlp(), device="tpu"), "device:"),
    (lambda: membench.workload_from_callables(_mlp, BATCH, LOSS, seed="x", name="bad_seed"), "seed:"),
])
def test_every_bad_api_argument_is_one_input_error_naming_it(call, named):
    with pytest.raises(membench.InputError) as raised:
        call()
    assert isinstance(raised.value, ValueError)
    assert str(raised.value).startswith(named) and "\n" not in str(raised.value), raised.value


def test_a_comma_list_of_strategies_is_the_command_lines_list():
    """`strategies="checkpoint"` to fit iterated its letters (`unknown strategy 'c'`); a comma list is a list."""
    rows = membench.fit(_mlp, BATCH, LOSS, budget="1MiB", max_batch=4, strategies="checkpoint", name="fit_text")
    assert [row["strategy"] for row in rows] == ["baseline", "checkpoint"]
    estimates = membench.estimate(_mlp, BATCH, LOSS, strategies="baseline, checkpoint", name="est_text")
    assert [e.strategy for e in estimates] == ["baseline", "checkpoint"]


def test_a_run_id_that_repeats_never_overwrites_the_earlier_runs_file(tmp_path, monkeypatch):
    """Same second, same random suffix: the second run's first write created the file anew over the first's."""
    from bench.cli import commands_analysis, commands_run

    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(commands_run, "new_run_id", lambda device="": "20261128T000000Z-cpu-0000")
    earlier = out / "20261128T000000Z-cpu-0000.csv"
    earlier.write_text("the earlier run's rows\n")
    done = _main("compare", "--strategies", "baseline", *TINY, "--out", out)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "exists already" in last and "not overwritten" in last, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and earlier.read_text() == "the earlier run's rows\n"

    monkeypatch.setattr(commands_analysis, "new_run_id", lambda device="": "20261128T000000Z-cpu-0000")
    table = out / "predict-20261128T000000Z-cpu-0000.csv"
    table.write_text("the earlier predictions\n")
    done = _main("predict", "--workload", MLP, "--device", "cpu", "--phases", "train", "--out", out)
    assert done.returncode == 2 and "exists already" in done.stderr.strip().splitlines()[-1], done.stderr[-2000:]
    assert table.read_text() == "the earlier predictions\n"


def test_a_workload_that_changes_the_default_dtype_does_not_change_the_next_ones_estimate():
    def leaky():
        model = torch.nn.Linear(8, 3)
        torch.set_default_dtype(torch.float64)  # set in the model's construction and never restored
        return model

    alone = membench.estimate(_mlp, BATCH, LOSS, name="dtype_clean").allocated_bytes
    membench.estimate(leaky, BATCH, LOSS, name="dtype_leaky")
    assert torch.get_default_dtype() == torch.float32
    assert membench.estimate(_mlp, BATCH, LOSS, name="dtype_clean_after").allocated_bytes == alone


# --- §3 tracebacks where one line is due -----------------------------------------------------------------------------

@pytest.mark.parametrize("html", [[], ["--html"]])
def test_report_of_an_anchors_table_is_one_line_naming_it(tmp_path, html):
    anchors_csv = next((ROOT / "results" / "reference" / "anchors").glob("anchors-*.csv"))
    done = _main("report", anchors_csv, *html, "--out", tmp_path)
    _one_line_exit_2(done, "anchors", "not a results file")  # was "a `predict` table", and a KeyError with --html


@pytest.mark.parametrize("dims, words", [
    ((4, -8), ["-8", "negative"]),
    ((4, 2**62), ["more bytes than a tensor can hold"]),
    ((2.5, 4), ["2.5", "whole number"]),
])
def test_a_shape_that_is_no_tensor_is_one_input_error(dims, words):
    with pytest.raises(membench.InputError) as raised:
        membench.Shape(*dims)
    assert all(word in str(raised.value) for word in words) and "\n" not in str(raised.value)


def test_a_bad_variable_read_on_import_is_one_line(tmp_path):
    env = {**os.environ, "MEMBENCH_ANCHOR_WORKER_BYTES": "lots"}
    done = _cli("anchors", "--only", "torchao", "--out", tmp_path, env=env)  # was a ValueError on import
    _one_line_exit_2(done, "MEMBENCH_ANCHOR_WORKER_BYTES='lots'")


def test_a_report_over_its_size_limit_is_one_line(tmp_path, monkeypatch):
    from bench.report import html

    monkeypatch.setattr(html, "PAGE_LIMIT_BYTES", 1000)
    path = tmp_path / REFERENCE_CSV.name
    shutil.copy(REFERENCE_CSV, path)
    done = _main("report", path, "--html", "--out", tmp_path / "report")
    _one_line_exit_2(done, "--html", "1,000", "nothing was written")  # was a 16-line ValueError traceback
    assert not list((tmp_path / "report").glob("*.html"))


def test_the_example_names_its_workload_from_any_folder(tmp_path, monkeypatch):
    """Examples/python_api.py copied into another folder and run from a third: its workload's spec (what the
    fake-CUDA process rebuilds it from) names the copy; a relative importable_as that names no file here is one
    InputError saying what to give."""
    import importlib.util

    from workloads import get_workload

    copy = tmp_path / "project" / "python_api.py"
    copy.parent.mkdir()
    shutil.copy(ROOT / "examples" / "python_api.py", copy)
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("copied_example", "project/python_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    workload = module.workload()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert workload.spec() == f"{copy}:workload"
    assert get_workload(workload.spec()).default_batch_size == module.BATCH  # what another process does
    with pytest.raises(membench.InputError, match="^importable_as: .*__file__"):
        membench.workload_from_callables(_mlp, BATCH, LOSS, name="relative", importable_as="project/python_api.py:w")


@pytest.mark.slow  # about 25 s: the fake-CUDA environment's torch in a process of its own
@pytest.mark.skipif(not (ROOT / ".venv-cuda-fake" / ".installed").exists(), reason="no fake-CUDA environment")
def test_the_example_estimates_cuda_when_run_from_another_folder(tmp_path):
    script = ("import sys; sys.path.insert(0, sys.argv[1]); import python_api; "
              "e = python_api.membench.estimate(python_api.workload(), gpu='RTX 4090'); print('STATUS', e.status)")
    done = subprocess.run([sys.executable, "-c", script, str(ROOT / "examples")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0 and "STATUS ok" in done.stdout, done.stderr[-2000:]


def test_fits_takes_its_target_and_headroom_as_plan_does():
    estimate = membench.estimate(_mlp, BATCH, LOSS, name="fits_args")
    assert estimate.fits(estimate.allocated_bytes) and estimate.fits("H100")
    for bad, named in ((dict(target="nope"), "target:"), (dict(target=-5), "target:"),
                       (dict(target=2**30, headroom=1.5), "headroom:")):
        with pytest.raises(membench.InputError, match=f"^{named}"):  # "nope" was a UsageError, -5 False
            estimate.fits(**bad)


def test_the_preflight_estimate_of_a_dtype_changing_workload_leaves_the_next_workloads_alone():
    """The pre-flight memory estimate of a sweep over several workloads runs each one's model in this process: the
    first one's default dtype doubled the next one's estimate."""
    from bench.cli.preflight_steps import _meta_baseline_peak
    from bench.run.case import Case

    hostile = ROOT / "tests" / "fixtures" / "hostile_workload.py"
    clean = Case(f"{hostile}:Tiny:mode=none", "baseline", "train", 2, "cpu")
    alone = _meta_baseline_peak(clean, 2)
    _meta_baseline_peak(Case(f"{hostile}:Tiny:mode=dtype", "baseline", "train", 2, "cpu"), 2)
    assert torch.get_default_dtype() == torch.float32 and _meta_baseline_peak(clean, 2) == alone
