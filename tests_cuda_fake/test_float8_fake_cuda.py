"""On fake CUDA, torchao's float8 training (`float8`) runs its float8 casts and `torch._scaled_mm` on fake tensors
(their meta kernels), alone, checkpointed and under FSDP2 per rank in one process: with `fsdp_float8_all_gather`
FSDP2 all-gathers every converted weight in float8, 1 byte a value, the other parameters in their dtype (counted
from the model's parameters); a GPU below compute capability 8.9 is an `unsupported` row that says why."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bench.analysis.fake_engine import tracked_step
from bench.analysis.predict import predict_case
from bench.core.memory_categories import COMMUNICATION
from bench.run.case import Case
from workloads import get_workload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs the fake-CUDA environment's torch")
pytest.importorskip("torchao.float8", reason="float8 needs torchao")

# units of 3 M parameters, every dimension a multiple of 16 (float8's Linears) and even (2 ranks' shards are halves)
WORKLOAD = "gpt_mini:layers=3:width=512:heads=4:seq_len=64:dropout=0.0"
RANKS = 2


def _case(spec: str) -> Case:
    return Case(workload=WORKLOAD, strategy=spec, phase="train", batch_size=4, device="cuda")


def _forward_all_gathered_bytes(step) -> int:
    """The bytes of the collective buffers the measured step's forward allocates."""
    window = max(i for i, event in enumerate(step.events) if event.kind == "reset")
    return sum(event.nbytes for event in step.events[window:]
               if event.kind == "alloc" and event.category == COMMUNICATION and event.stage == "forward")


def _parameters() -> tuple[int, int]:
    """(every parameter, the values of the weights float8 converts: every Linear's but the output head's)."""
    workload = get_workload(WORKLOAD)
    model = workload.model_structure()
    head = workload.output_head(model)
    converted = sum(m.weight.numel() for m in model.modules() if type(m) is nn.Linear and m is not head)
    return sum(p.numel() for p in model.parameters()), converted


@pytest.mark.parametrize("spec", ["float8", "checkpoint+float8:recipe=rowwise"])
def test_float8_runs_on_fake_cuda_tensors(spec):
    step = tracked_step(_case(spec), spec, "fake-cuda", warmup_steps=1)
    total, _ = _parameters()
    assert step.peak_bytes > 4 * total  # weights, gradients and AdamW's state at least: the step ran to its end


@pytest.mark.parametrize("param_dtype, bytes_per_value", [("none", 4), ("bfloat16", 2)])
def test_fsdp_float8_all_gather_gathers_the_converted_weights_in_one_byte(param_dtype, bytes_per_value):
    fsdp = "fsdp" if param_dtype == "none" else f"fsdp:param_dtype={param_dtype}"
    plain = tracked_step(_case(f"{fsdp}+float8"), f"{fsdp}+float8", "fake-cuda", ranks=RANKS,
                         record_events=True, warmup_steps=1)
    spec = f"{fsdp}+float8:fsdp_float8_all_gather=true"
    gathered = tracked_step(_case(spec), spec, "fake-cuda", ranks=RANKS, record_events=True, warmup_steps=1)
    total, converted = _parameters()
    # without the option FSDP2 gathers the weights in their (or param_dtype's) dtype, float8 casts them afterwards
    assert _forward_all_gathered_bytes(plain) == bytes_per_value * total
    assert _forward_all_gathered_bytes(gathered) == converted + bytes_per_value * (total - converted)
    assert gathered.peak_bytes < plain.peak_bytes


@pytest.mark.parametrize("capability", [(8, 0), (8, 6)])
def test_a_gpu_below_8_9_is_an_unsupported_row(capability):
    row = predict_case(_case("float8"), "fake-cuda", capability=capability)
    assert row["status"] == "unsupported", row
    assert "float8 needs compute capability 8.9 or later" in row["message"]
    assert f"{capability[0]}.{capability[1]}" in row["message"]
