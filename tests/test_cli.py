"""The command line: one-line errors with exit code 2, and an end-to-end compare on the CPU."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from bench.cli.main import main
from bench.core import results
from cli_helpers import cli_many

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("args, names", [
    (["compare", "--strategies", "nonsense"], ["'nonsense'", "baseline"]),
    (["compare", "--strategies", "baseline", "--workload", "resnet50"], ["'resnet50'", "captcha_resnet18"]),
    (["compare", "--strategies", "baseline", "--batch-size", "0"], ["0", "positive"]),
    (["compare", "--strategies", "baseline", "--batch-size", "-5"], ["-5", "positive"]),
    (["compare", "--strategies", "baseline", "--phases", "test"], ["'test'", "train, eval"]),
    (["compare", "--strategies", "baseline", "--data", "mnist"], ["'mnist'", "captcha, synthetic"]),
    (["compare", "--strategies", "baseline", "--device", "tpu"], ["'tpu'", "auto, cpu, cuda"]),
    (["frobnicate"], ["'frobnicate'", "compare"]),
    (["compare", "--strategies", "checkpoint", "--workload", "nope.py:x"], ["--workload", "'nope.py'"]),
    (["compare", "--strategies", "checkpoint", "--workload", "deep_mlp:layers=abc"], ["'abc'", "deep_mlp:layers"]),
    (["compare", "--strategies", "baseline", "--workload", "deep_mlp", "--data", "captcha"],
     ["'captcha'", "deep_mlp", "synthetic"]),
    (["explain", "--strategy", "baseline", "--workload", "nope.py:x"], ["'nope.py'"]),
    (["predict", "--workload", "deep_mlp:width=0"], ["deep_mlp:width=0"]),
    (["fit", "--budget", "1GiB", "--workload", "unet:depth=x"], ["'x'", "unet:depth"]),
    (["compare", "--strategies", "baseline", "--min-steps", "0"], ["--min-steps", "0", "positive integer"]),
    (["compare", "--strategies", "baseline", "--max-time-per-case", "-1"], ["--max-time-per-case", "'-1'"]),
    (["compare", "--strategies", "baseline", "--max-time-per-case", "soon"], ["--max-time-per-case", "'soon'"]),
    (["compare", "--strategies", "baseline", "--target-ci", "1.5"], ["--target-ci", "'1.5'", "between 0 and 1"]),
    (["compare", "--strategies", "baseline", "--target-ci", "0"], ["--target-ci", "'0'", "between 0 and 1"]),
    (["compare", "--strategies", "baseline", "--steps", "3", "--min-steps", "2"], ["--steps 3", "--min-steps"]),
])
def test_bad_input_is_one_line_exit_2(args, names, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    for name in names:
        assert name in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_without_gpu_is_a_usage_error(capsys):
    assert main(["compare", "--strategies", "baseline", "--device", "cuda"]) == 2
    assert "cuda" in capsys.readouterr().err


def test_malformed_suite_names_the_bad_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("strategies: [baseline]\nbatch_size: [100]\n")
    assert main(["run", "--suite", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "'batch_size'" in err and "batch_sizes" in err and str(bad) in err
    bad.write_text("strategies: [baseline\n")
    assert main(["run", "--suite", str(bad)]) == 2
    assert "malformed YAML" in capsys.readouterr().err


def test_subprocess_errors_have_no_traceback_and_list_and_env_print_their_tables():
    # all in one real process (cli_many: one import of torch, not four), each command's output caught as its own
    nonsense, missing, listed, env = cli_many(("compare", "--strategies", "nonsense"),
                                              ("compare", "--workload", "nope.py:x", "--strategies", "checkpoint"),
                                              ("list",), ("env", "--device", "cpu"))
    for proc in (nonsense, missing):
        assert proc.returncode == 2
        assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
        assert "valid choices" in proc.stderr or "does not exist" in proc.stderr
    assert listed.returncode == 0 and "captcha_resnet18" in listed.stdout and "baseline" in listed.stdout
    assert env.returncode == 0
    for key in ("torch_version", "cuda_version", "cudnn_version", "device_name", "cpu_threads", "git_commit"):
        assert key in env.stdout


@pytest.mark.slow  # among the longest of make test: CI runs it in its step of long tests (.ci/run)
def test_compare_end_to_end_on_cpu(tmp_path):
    proc = _cli("compare", "--strategies", "baseline", "--device", "cpu", "--batch-size", "2",
                "--warmup", "0", "--steps", "1", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "baseline" in proc.stdout and "peak MiB" in proc.stdout
    [csv] = [p for p in tmp_path.glob("*.csv") if not p.name.endswith(".timeline.csv")]
    frame = pd.read_csv(csv)
    timeline = pd.read_csv(csv.with_suffix(".timeline.csv"))
    assert set(timeline["stage"]) == {"forward", "backward", "optimizer"}
    assert timeline["live_bytes"].max() == frame.loc[frame["phase"] == "train", "peak_mem_bytes"].item()
    assert list(frame.columns) == results.COLUMNS
    assert list(frame["phase"]) == ["train", "eval"] and set(frame["status"]) == {"ok"}
    assert (frame["schema_version"] == results.SCHEMA_VERSION).all()
    assert (frame["memory_method"] == "cpu_live_tensor_bytes").all()
    assert (frame["peak_mem_bytes"] > 11_242_704 * 4).all()
    assert frame["matches_baseline"].all()
    assert "[2/2]" in proc.stderr  # progress display


def test_report_redraws_a_run_from_its_csv_alone(tmp_path, capsys):
    fixture = ROOT / "tests" / "fixtures" / "single_batch.csv"
    assert main(["report", str(fixture), "--out", str(tmp_path), "--budget", "4GiB"]) == 0
    assert (tmp_path / "single_batch.REPORT.md").is_file() and list(tmp_path.glob("*.png"))
    assert main(["report", "--budget", "4 furlongs", str(fixture)]) == 2
    assert "furlongs" in capsys.readouterr().err
    assert main(["report", "--results", str(tmp_path / "empty")]) == 2


@pytest.mark.parametrize("command", ["explain", "predict", "fit"])
def test_every_command_that_computes_takes_threads(command, monkeypatch, tmp_path):
    """--threads sets torch's threads (and OMP_NUM_THREADS for a worker process) while the command computes, and
    restores both; more threads than cores is one line and exit 2."""
    import os

    import torch

    from bench.cli import commands_analysis

    seen = {}

    def record(*args, **kwargs):
        seen["threads"], seen["omp"] = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
        raise KeyboardInterrupt  # stop before any real work: what matters is the state it ran in

    target = {"explain": (commands_analysis.analysis, "explain"),
              "predict": (commands_analysis.predict, "predict_cases"),
              "fit": (commands_analysis.fitting, "fit")}[command]
    monkeypatch.setattr(*target, record)
    before, omp_before = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    args = {"explain": ["--strategy", "baseline", "--batch-size", "2"], "predict": ["--device", "cpu"],
            "fit": ["--budget", "1GiB", "--time-steps", "0"]}[command]
    assert main([command, *args, "--threads", "1", *(["--out", str(tmp_path)] if command != "explain" else [])]) == 130
    assert seen == {"threads": 1, "omp": "1"}
    assert torch.get_num_threads() == before and os.environ.get("OMP_NUM_THREADS") == omp_before
    assert main([command, *args, "--threads", "4096"]) == 2


def test_quick_with_adaptive_timing_says_which_wins_and_compare_says_how_to_draw_the_charts(tmp_path, capsys):
    """--quick beside --max-time-per-case: one stderr line before the first case says the adaptive option wins over
    --quick's 3 steps; the run ends with the command that draws its charts."""
    assert main(["compare", "--strategies", "baseline", "--workload", "deep_mlp:layers=2:width=8", "--device", "cpu",
                 "--batch-size", "2", "--phases", "train", "--quick", "--max-time-per-case", "0.5",
                 "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    [note] = [line for line in err.splitlines() if "--quick" in line]
    assert "--max-time-per-case wins over --quick's 3 measured steps" in note and "after 0.5 s" in note
    assert err.index(note) < err.index("[1/1]")
    [csv] = [p for p in tmp_path.glob("*.csv") if not p.name.endswith(".timeline.csv")]
    assert out.splitlines()[-1] == f"charts: python -m bench report {csv}"
    assert main(["compare", "--strategies", "baseline", "--workload", "deep_mlp:layers=2:width=8", "--device", "cpu",
                 "--batch-size", "2", "--phases", "train", "--quick", "--out", str(tmp_path)]) == 0
    assert "wins over --quick" not in capsys.readouterr().err


def test_cuda_without_gpu_says_how_to_install_a_cuda_build(monkeypatch, capsys):
    """`make bench DEVICE=cuda` on a machine without a GPU: one line, exit 2, and with a CPU-only torch the pip
    command for PyPI's CUDA build of the same release."""
    from bench.run.preflight import no_cuda_message

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert main(["run", "--suite", str(ROOT / "bench" / "suites" / "default.yaml"), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA device" in err and "-m pip install 'torch===" in err
    assert "pip install 'torch===2.13.0'" in no_cuda_message("2.13.0+cpu", None)
    assert "nvidia-smi" in no_cuda_message("2.13.0+cu128", "12.8") and "pip" not in no_cuda_message("2.13.0", "12.8")
