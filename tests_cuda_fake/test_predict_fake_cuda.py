"""predict's fake-cuda engine: CUDA's own operators on fake tensors, every strategy, and the route to it from the
CPU-only environment (`python -m bench predict --device cuda` in .venv hands the whole command to this environment,
or with MEMBENCH_FAKE_CUDA_HANDED_OVER set its cases: the same bytes).

Asserted: every registered strategy is predicted on CUDA's operators (no silent fall-back to the CPU's), what those
operators change against the fake engine's CPU operators (cuDNN's batch norm, GradScaler's unscaling, Adam's
`foreach` implementation and the temporaries it allocates), the allocator model's reserved figure above the
allocated one, and the assumptions printed for the engine used. Not asserted: that the figures match a GPU's (the
cuda-marked tests/test_cuda_prediction.py does that on a real one).
"""

from __future__ import annotations

import os
import re
import subprocess
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
import torch

from bench.analysis import predict
from bench.cli.fake_cuda_handover import HANDED_OVER_VARIABLE
from bench.run.case import Case
from strategies import STRATEGIES
from tests_cuda_fake.test_cuda_path import DEVICE_INDEPENDENT_REASONS, WORKLOADS

ROOT = Path(__file__).resolve().parent.parent
BATCH = 2
PREDICT_REASONS = DEVICE_INDEPENDENT_REASONS  # compile included: its graphs run on the fake tensors


def cuda_case(spec: str, phase: str = "train", workload: str = "captcha_resnet18") -> Case:
    return Case(WORKLOADS[workload], spec, phase, BATCH, "cuda", data="synthetic")


@pytest.mark.parametrize("phase", ["train", "eval"])
@pytest.mark.parametrize("spec", list(STRATEGIES.names()) + ["checkpoint+amp"])
def test_every_strategy_is_predicted_on_cudas_operators(spec, phase):
    (row,) = predict.predict_cases([cuda_case(spec, phase)])
    if row["status"] == "unsupported":
        assert any(re.search(reason, row["message"]) for reason in PREDICT_REASONS), row["message"]
        return
    assert row["status"] == "ok" and row["engine"] == "fake-cuda", row
    assert "engine failed" not in row["message"], row["message"]
    assert 0 < row["predicted_bytes"] <= row["predicted_reserved_bytes"]
    assert row["predicted_reserved_bytes"] % (2 * 2**20) == 0  # whole 2 MiB or 20 MiB segments


def test_a_prediction_may_exceed_the_device_that_torch_sees():
    """The stubs' device has 80 GiB: a case that needs more is predicted, not an out-of-memory fall-back."""
    (row,) = predict.predict_cases([Case(WORKLOADS["captcha_resnet18"], "baseline", "eval", 10_000, "cuda",
                                         data="synthetic")])
    assert row["engine"] == "fake-cuda" and "engine failed" not in row["message"], row
    assert row["predicted_bytes"] > torch.cuda.get_device_properties(0).total_memory


def test_sharded_strategies_are_predicted_per_rank_on_fake_cuda():
    """FSDP2, DDP and ZeRO-1 (which trains a DDP model) run on fake CUDA tensors, each rank in turn in the fake process
    group (DDP past its host bookkeeping: strategies/framework/sharding.py)."""
    rows = predict.predict_cases([cuda_case(spec, workload="gpt_mini") for spec in ("fsdp", "fsdp+amp", "ddp", "zero1")],
                                 ranks=2)
    assert [(row["status"], row["engine"], row["ranks"]) for row in rows] == [
        ("ok", "fake-cuda", 2)] * 4, rows


def engine_ops(engine: str, spec: str) -> tuple[int, Counter]:
    """(tracked peak, operators run) of one training step of the ResNet on `engine`."""
    step = predict.tracked_step(cuda_case(spec), spec, engine, 1, record_events=True, warmup_steps=1)
    return step.peak_bytes, Counter(e.op.split(".")[0] for e in step.events if e.kind == "op")


def test_the_fake_cuda_engine_runs_what_cuda_runs_where_the_fake_engine_runs_the_cpus_operators():
    cuda_peak, cuda_ops = engine_ops("fake-cuda", "amp")
    cpu_peak, cpu_ops = engine_ops("fake", "amp")
    # cuDNN's batch norm, GradScaler's unscaling and overflow check, Adam's multi-tensor implementation
    for op in ("cudnn_batch_norm", "cudnn_batch_norm_backward", "_amp_foreach_non_finite_check_and_unscale_",
               "_amp_update_scale_", "_foreach_sqrt", "_foreach_addcdiv_"):
        assert cuda_ops[op] and not cpu_ops[op], op
    for op in ("native_batch_norm", "sqrt", "addcdiv_"):  # the CPU's batch norm, Adam's per-parameter loop
        assert cpu_ops[op] and not cuda_ops[op], op
    # at batch 2 the peak is Adam's step: `_foreach_sqrt` holds a temporary of every parameter at once where the
    # loop holds one parameter's; so CUDA's peak is higher, by less than the parameters' bytes
    model = predict.bind_case(cuda_case("baseline"))[0].context.workload.build_model()
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 0 < cuda_peak - cpu_peak < parameter_bytes, (cuda_peak, cpu_peak, parameter_bytes)


def test_predict_from_the_cpu_only_environment_runs_its_cuda_cases_here_with_the_workers_bytes(tmp_path):
    """`python -m bench predict --device cuda` in .venv (CPU torch) hands the whole command to this environment's
    Python before importing torch (bench.cli.fake_cuda_handover): one process, whose CSV is the worker path's
    (the command kept in .venv, its cases sent to `bench.analysis._predict_worker` here) to the byte."""
    cpu_python = ROOT / ".venv" / "bin" / "python"
    if not cpu_python.exists():
        pytest.skip("no .venv in this checkout (`make install` builds it)")
    env = {name: value for name, value in os.environ.items() if name != HANDED_OVER_VARIABLE}

    def predict_from_cpu_python(out: Path, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(cpu_python), "-m", "bench", "predict", "--device", "cuda", "--workload",
                               WORKLOADS["gpt_mini"], "--batch-size", str(BATCH), "--strategies", "amp", "--phases",
                               "train", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**env, **extra})

    handed = predict_from_cpu_python(tmp_path / "handed")
    worker = predict_from_cpu_python(tmp_path / "worker", **{HANDED_OVER_VARIABLE: "kept in .venv"})
    for done in (handed, worker):
        assert done.returncode == 0, done.stderr[-2000:]
    assert "on fake CUDA" in worker.stderr  # the worker's progress: its cases went to a second Python
    assert "on fake CUDA" not in handed.stderr and "predicting amp train" in handed.stderr  # the command's own
    (handed_csv,), (worker_csv,) = (list((tmp_path / kind).glob("predict-*.csv")) for kind in ("handed", "worker"))
    assert handed_csv.read_bytes() == worker_csv.read_bytes()
    frame = pd.read_csv(handed_csv)
    assert list(frame["strategy"]) == ["amp"]  # the baseline is predicted only where asked for
    assert list(frame["engine"]) == ["fake-cuda"] and list(frame["status"]) == ["ok"]
    assert handed.stdout.replace(str(handed_csv), "") == worker.stdout.replace(str(worker_csv), "")
    assumptions = handed.stdout.split("assumptions:")[1]
    assert "engine fake-cuda" in assumptions and "engine fake:" not in assumptions


def test_a_compiled_step_runs_its_partition_on_fake_cuda():
    """compile:scope=layers:loss=true (torchtune's compile_model and compile_loss) on fake CUDA: each graph is
    partitioned as inductor partitions it, so the forward saves less than eager for backward, and the graphs inductor
    allocates every buffer of (the loss's) replay inductor's generated code, compiled for the CPU."""
    def case(spec: str) -> Case:
        return Case("hf:tiny-llama:seq_len=128", spec, "train", 2, "cuda", data="synthetic")

    eager = predict.predict_case(case("bf16_weights"), engine="fake-cuda")
    compiled = predict.predict_case(case("bf16_weights+compile:scope=layers:loss=true"), engine="fake-cuda")
    assert compiled["status"] == "ok" and compiled["engine"] == "fake-cuda", compiled["message"]
    assert "from its generated code" in compiled["message"]
    assert compiled["predicted_activations_bytes"] < eager["predicted_activations_bytes"], (compiled, eager)


def test_a_worker_prints_nothing_of_triton():
    """torch.utils.flop_counter warns "triton not found" when a CUDA torch has no triton; membench runs no triton
    kernel there (nothing of the answer), so a worker's import of the counting code says nothing."""
    import sys

    done = subprocess.run([sys.executable, "-c", "import bench.run.passes, bench.measure.op_cost"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "triton" not in done.stderr, done.stderr
    bare = subprocess.run([sys.executable, "-c", "import torch.utils.flop_counter"], capture_output=True, text=True,
                          timeout=120)
    assert "triton not found" in bare.stderr  # what is silenced is there to silence in this environment
