"""tools/gpu/check.py without a GPU (`--device cpu`): each case measured in a fresh process beside its prediction,
the rows written as they come; on the CPU, where membench's count is exact, the two are equal to the byte."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from bench.core.check_tables import GPU_CHECK

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # in .ci/run's long tests of make test
def test_each_case_is_measured_and_predicted_in_its_own_process_and_an_unsupported_one_is_a_row(tmp_path):
    done = subprocess.run([sys.executable, "tools/gpu/check.py", "--device", "cpu", "--no-anchors", "--out",
                           str(tmp_path), "--jobs", "2", "--case", "captcha_resnet18,no_grad_eval,eval,2",
                           "--case", "captcha_resnet18,empty_cache,train,2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    [csv] = tmp_path.glob("gpu-check-*.csv")
    rows = pd.read_csv(csv).set_index("strategy")
    ok = rows.loc["no_grad_eval"]
    assert ok["status"] == "ok" and ok["measured_bytes"] == ok["predicted_bytes"] > 0 and ok["error_pct"] == 0
    # empty_cache needs CUDA: refused by the strategy's own check, a row that says why, not a crash
    refused = rows.loc["empty_cache"]
    assert refused["status"] == "unsupported" and "cuda" in refused["message"]
    assert (tmp_path / csv.name.replace(".csv", ".md")).exists()
    assert list(pd.read_csv(csv).columns) == GPU_CHECK.names and (rows["schema_version"] == GPU_CHECK.version).all()


def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(tmp_path):
    done = subprocess.run([sys.executable, "tools/gpu/check.py", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "needs a GPU" in done.stderr and "--device cpu" in done.stderr and not list(tmp_path.iterdir())
