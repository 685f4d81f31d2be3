"""membench's CUDA code path on fake CUDA tensors: every strategy on every built-in workload, train and eval.

Runs only in the environment `make test-cuda-fake` builds (conftest.py skips it elsewhere). Each case goes through
the runner's CUDA branch (`run_case`: plan, timing pass, memory pass with the allocator's statistics, OOM handling),
on tensors that have shapes, dtypes and devices but no data (see fake_mode.py). Asserted: the row's status, every
tensor of the measured steps on the GPU (host memory only where the strategy puts it there), the dtypes autocast
gives, GradScaler's scaling and unscaling, cuDNN's benchmark flag during the steps and every process-wide flag
after the case. Not asserted: memory figures (the count here is of fake tensors, not of CUDA's allocator),
numerics (no verification against the baseline: fake tensors have no values), timing.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from bench.measure.fake_cuda import TIMM_UNAVAILABLE_FILE, worker_environment
from bench.measure.fake_cuda_mode import FakeAllocator
from bench.run import isolation
from bench.run.isolation import RunOptions, run_in_worker
from bench.run.case import Case
from bench.run.runner import run_case, run_cases
from strategies import STRATEGIES
from strategies.framework.base import PHASE_REFUSAL
from tests_cuda_fake.fake_mode import fake_cuda
from workloads import WORKLOADS as WORKLOAD_CLASSES, workload_names

ROOT = Path(__file__).resolve().parent.parent
BATCH = 2
# each built-in workload at the size its class declares for this grid (`small_for["fake_cuda"]`), one whose fake
# steps take a second or two (a fake operator costs the same at any size: what counts is the number of operators,
# so the deep ones are made shallow); None leaves a workload out of it
WORKLOADS = {name: WORKLOAD_CLASSES.get(name).small_case("fake_cuda")[0] for name in workload_names()
             if WORKLOAD_CLASSES.get(name).small_case("fake_cuda") is not None}


def missing_timm_reason() -> str | None:
    """Why this environment has no timm (None: it has), from the note `make cuda-fake-env` leaves when pip failed."""
    if importlib.util.find_spec("timm") is not None:
        return None
    note = Path(sys.prefix) / TIMM_UNAVAILABLE_FILE
    why = note.read_text().strip() if note.exists() else "`make cuda-fake-env` installs it"
    return f"the `timm:` workload's cases need timm and torchvision, not in {sys.prefix}: {why}"


def suite_compositions() -> list[str]:
    """The compositions (`checkpoint+amp`) that the suite files in bench/suites/ run."""
    specs: list[str] = []
    for path in sorted((ROOT / "bench" / "suites").glob("*.yaml")):
        specs += [s for s in yaml.safe_load(path.read_text())["strategies"] if "+" in s and s not in specs]
    return specs


def cases() -> list:
    """(workload name, strategy spec, phase): every registered strategy with its default settings, and every
    composition a suite runs, on every built-in workload, train and eval; timm's skipped where timm is missing."""
    specs = list(STRATEGIES.names()) + suite_compositions()
    reason = missing_timm_reason()
    skip_timm = [pytest.mark.skip(reason=reason)] if reason else []
    return [pytest.param(name, spec, phase, marks=skip_timm if name == "timm" else [])
            for name in WORKLOADS for spec in specs for phase in ("train", "eval")]


# Why a case may be `unsupported` on CUDA: the strategy says so, for reasons that have nothing to do with the device
# (each strategy declares its own, `refusals`; the phase refusal is the base class's).
DEVICE_INDEPENDENT_REASONS = [PHASE_REFUSAL, *dict.fromkeys(
    pattern for name in STRATEGIES.names() for pattern in STRATEGIES.get(name).refusals)]
# operators of a step that may touch host memory, by strategy: the batch each step loads from the host, saved
# activations offloaded to it
HOST_OPS = {
    "pinned_loader": {"_to_copy", "pin_memory", "_pin_memory", "stack", "select", "is_pinned", "copy_"},
    "offload": {"_to_copy", "empty", "copy_", "pin_memory", "_pin_memory", "is_pinned", "empty_strided", "detach"},
    "offload_activations": {"_to_copy", "empty_like", "empty", "copy_", "pin_memory", "_pin_memory", "is_pinned",
                            "empty_strided", "detach"},
}
MATMULS = ("mm", "addmm", "bmm", "convolution", "cudnn_convolution", "_scaled_dot_product_efficient_attention",
           "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention", "baddbmm")
FP32_UNDER_AUTOCAST = ("_softmax", "_log_softmax", "native_layer_norm", "mse_loss", "binary_cross_entropy")
CONVOLUTIONS = ("convolution", "cudnn_convolution")


def components(spec: str) -> set[str]:
    """The strategy names a spec composes (`checkpoint:segments=2+amp` -> {checkpoint, amp})."""
    return {part.split(":")[0] for part in spec.split("+")}


@pytest.mark.parametrize("workload,spec,phase", cases())
def test_case_runs_through_the_cuda_path(workload, spec, phase):
    flags_before = isolation._flags()
    case = Case(WORKLOADS[workload], spec, phase, BATCH, "cuda", data="synthetic", warmup=0, steps=1)
    with fake_cuda(record=True) as (scaler, record):
        row = run_case(case, None, RunOptions(threads=1), verify_result=False)
    assert isolation._flags() == flags_before, "a process-wide flag was left changed"
    if row["status"] == "unsupported":
        assert any(re.search(reason, row["message"]) for reason in DEVICE_INDEPENDENT_REASONS), row["message"]
        return
    assert row["status"] == "ok", row["message"]
    assert (row["device"], row["device_name"]) == ("cuda", torch.cuda.get_device_name(0))
    assert row["memory_method"] == "cuda_max_memory_allocated" and row["peak_mem_bytes"] > 0

    used = components(spec)
    allowed_host = set().union(*(HOST_OPS.get(name, set()) for name in used))
    on_host = {op for op, devices in record.devices.items() if "cpu" in devices and op not in allowed_host}
    assert not on_host, f"operators on host tensors during the steps: {sorted(on_host)}"
    assert record.calls, "the steps ran no operator"

    matmul_dtypes = set().union(*(record.forward_dtypes.get(op, set()) for op in MATMULS))
    assert matmul_dtypes, "no matmul or convolution in the forward"
    if "amp" in used:
        assert matmul_dtypes == {torch.float16}, f"autocast float16 gave {matmul_dtypes}"
        for op in FP32_UNDER_AUTOCAST:
            assert record.forward_dtypes.get(op, {torch.float32}) <= {torch.float32}, op
    else:
        assert torch.float16 not in set().union(*record.forward_dtypes.values()), "float16 without amp"
    if "amp" in used and phase == "train":
        steps = 1 + 2  # the timing pass's step, the memory pass's warm-up and measured steps
        assert scaler.steps >= steps and scaler.scaled >= steps and scaler.unscaled == scaler.steps
        assert record.calls["_amp_foreach_non_finite_check_and_unscale_"] >= steps
        assert record.calls["_amp_update_scale_"] >= steps
    else:
        assert scaler.scaled == scaler.steps == 0
    if any(record.calls[op] for op in CONVOLUTIONS):
        assert record.cudnn_benchmark == {"cudnn_benchmark" in used}


def test_timm_imports_torchvision_with_its_compiled_operators():
    """torchvision's operator library loads against the stubs (bench/measure/cuda_stubs.py reads what it imports), so
    timm imports as it does beside a GPU, not through the workload's stand-ins for a torchvision whose operators did
    not load."""
    if missing_timm_reason():
        pytest.skip(missing_timm_reason())
    from workloads import timm_models

    timm_models.import_timm()
    import torchvision

    assert torchvision.extension._has_ops(), "torchvision's _C.so did not load against the stub CUDA libraries"
    assert not timm_models._torchvision_stand_ins, "timm imported through the stand-ins for torchvision's operators"


def test_an_out_of_memory_case_is_an_oom_row_and_the_sweep_goes_on():
    small = Case(WORKLOADS["deep_mlp"], "baseline", "train", BATCH, "cuda", data="synthetic", warmup=0, steps=1)
    large = replace(small, workload=WORKLOADS["captcha_resnet18"])
    with fake_cuda(allocator=FakeAllocator(limit_bytes=1 << 20)):  # the ResNet's weights alone are 45 MB
        rows = run_cases([large, small], options=RunOptions(threads=1))  # verified against the baseline, too
    assert [row["status"] for row in rows] == ["oom", "ok"], [row["message"] for row in rows]
    assert "out of memory" in rows[0]["message"]


def test_the_isolated_worker_runs_a_case_on_fake_cuda(monkeypatch):
    for name, value in worker_environment({}).items():
        if name != "PYTHONPATH":
            monkeypatch.setenv(name, value)
    case = Case(WORKLOADS["captcha_resnet18"], "checkpoint+amp", "train", BATCH, "cuda", data="synthetic",
                warmup=0, steps=1)
    row = run_in_worker(case, None, RunOptions(threads=1, isolate=True), verify=False).row
    assert row["status"] == "ok", row["message"]
    assert row["isolated"] and row["device_name"] == torch.cuda.get_device_name(0)
    assert "amp.dtype=float16" in row["strategy_settings"]


def run_cli(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """`python -m bench ARGS --out tmp_path` in this Python, its workers on fake CUDA."""
    return subprocess.run([sys.executable, "-m", "bench", *args, "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, env=worker_environment(), timeout=300)


def rows_of(tmp_path: Path) -> list[dict]:
    """The rows of the one results CSV in `tmp_path`."""
    import pandas as pd

    (path,) = [p for p in tmp_path.glob("*.csv") if not p.name.endswith(".timeline.csv")]
    return pd.read_csv(path).to_dict("records")


def test_bench_run_on_cuda_isolates_each_case_in_a_worker(tmp_path):
    done = run_cli("run", "--device", "cuda", "--strategies", "baseline,amp,cudnn_benchmark", "--workload",
                   WORKLOADS["unet"], "--data", "synthetic", "--batch-size", str(BATCH), "--phases", "train",
                   "--warmup", "0", "--steps", "1", "--threads", "1", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = rows_of(tmp_path)
    assert [(r["strategy"], r["status"], bool(r["isolated"])) for r in rows] == [
        ("baseline", "ok", True), ("amp", "ok", True), ("cudnn_benchmark", "ok", True)], rows
    # verification is on, but fake tensors have no values to compare: not a mismatch, an empty column that says why
    assert all(r["matches_baseline"] != r["matches_baseline"] for r in rows), rows  # NaN: empty in the CSV
    assert all(r["message"].startswith("not verified: the step ran on fake tensors") for r in rows), rows
    assert "DOES NOT MATCH" not in done.stdout + done.stderr


def test_memory_limit_caps_every_isolated_case(tmp_path):
    """--memory-limit is a limit of the process that sets it: each isolated worker must set it again."""
    done = run_cli("run", "--device", "cuda", "--strategies", "baseline", "--workload", WORKLOADS["captcha_resnet18"],
                   "--data", "synthetic", "--batch-size", str(BATCH), "--phases", "train", "--warmup", "0",
                   "--steps", "1", "--threads", "1", "--memory-limit", "1MiB", tmp_path=tmp_path)
    (row,) = rows_of(tmp_path)
    assert row["status"] == "oom", row
    assert done.returncode == 1 and "no case succeeded" in done.stderr
