"""predict on fake CUDA for the hf: models, at full size: the weights never exist (llama-3.1-8b's 32 GB of float32
weights are counted, not allocated), the peak by category adds up, and the attention kernel of
scaled_dot_product_attention is the one CUDA chooses (PyTorch's own checks, the hardware ranges and priority order of
sdp_utils.cpp for a compute capability), run by the fake trace (its own operator, so its own outputs: logsumexp,
cuDNN's statistics) and named in the row.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from torch.nn import functional as F

from bench.analysis import predict
from bench.cli.analysis_console import format_predictions
from bench.measure.fake_cuda_mode import FakeAllocator, fake_cuda
from bench.measure.memory import LiveTensorTracker
from bench.measure.sdpa_kernel import SdpaKernelChoice, chosen_kernel
from bench.run.case import Case

CUDNN = 92000  # cuDNN 9.20.0: newer than 9.15, so preferred on sm90


def attention_inputs(dtype, kv_heads: int = 8, head_dim: int = 64, seq: int = 256):
    q = torch.randn(1, 8, seq, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    kv = torch.randn(1, kv_heads, seq, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    return q, kv


@pytest.mark.parametrize("dtype, gqa, capability, expected", [
    (torch.float32, False, (9, 0), "efficient"),  # flash and cuDNN take 16-bit inputs only
    (torch.float32, True, (9, 0), "math"),  # the memory-efficient kernel has no grouped-query heads
    (torch.bfloat16, False, (9, 0), "cudnn"),  # preferred on sm90 with cuDNN > 9.15
    (torch.bfloat16, True, (9, 0), "cudnn"),  # cuDNN runs grouped-query heads too
    (torch.bfloat16, True, (8, 0), "flash"),
    (torch.bfloat16, False, (8, 0), "flash"),  # sm80: the default order, flash first
    (torch.float16, False, (7, 5), "efficient"),  # a T4: no flash, no cuDNN attention
])
def test_the_kernel_cuda_chooses(dtype, gqa, capability, expected):
    with fake_cuda(allocator=FakeAllocator(limit_bytes=sys.maxsize)):
        q, kv = attention_inputs(dtype, kv_heads=2 if gqa else 8)
        assert chosen_kernel(q, kv, kv, None, 0.0, True, gqa, capability, CUDNN) == expected


@pytest.mark.parametrize("capability, kernel, op", [
    ((9, 0), "cudnn", "_scaled_dot_product_cudnn_attention"),
    ((8, 0), "flash", "_scaled_dot_product_flash_attention"),
    ((7, 5), "efficient", "_scaled_dot_product_efficient_attention"),
])
def test_the_fake_trace_runs_the_kernel_named(capability, kernel, op):
    choice = SdpaKernelChoice(capability)
    tracker = LiveTensorTracker("cuda", record_events=True)
    with fake_cuda(allocator=FakeAllocator(limit_bytes=sys.maxsize), inner=[choice, tracker]):
        q, kv = attention_inputs(torch.float16)
        F.scaled_dot_product_attention(q, kv, kv, is_causal=True).sum().backward()
    ops = {event.op.split(".")[0] for event in tracker.events if event.kind == "op"}
    assert choice.kernels == [kernel] and choice.summary() == kernel
    assert op in ops and f"{op}_backward" in ops, ops
    others = {"_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention"} - {op}
    assert not ops & others


def hf_row(spec: str, capability=None) -> dict:
    (row,) = predict.predict_cases([Case("hf:tiny-llama:seq_len=64", spec, "train", 1, "cuda", data="synthetic")],
                                   capability=capability)
    assert row["status"] == "ok" and row["engine"] == "fake-cuda", row
    return row


def test_predict_names_the_kernel_of_a_llama_and_its_memory_follows():
    # tiny-llama has grouped-query heads (4 for 2): in float32 only math runs them, under float16 autocast cuDNN
    # does on the stubs' sm90, flash on an sm80; math materialises the (seq x seq) attention of every head
    full, mixed = hf_row("baseline"), hf_row("amp")
    assert full["sdpa_kernel"] == "math" and mixed["sdpa_kernel"] == "cudnn"
    assert hf_row("amp", capability=(8, 0))["sdpa_kernel"] == "flash"
    assert "sdpa: math" in format_predictions([full])
    old = hf_row("amp", capability=(7, 5))  # a T4: neither flash nor cuDNN; grouped-query heads: math
    assert old["sdpa_kernel"] == "math"
    assert old["predicted_activations_bytes"] > mixed["predicted_activations_bytes"]


def test_a_checkpointed_first_case_runs_on_fake_cuda_in_a_fresh_process():
    # torch.utils.checkpoint refuses a CUDA state first initialised inside its forward: the fake-CUDA mode initialises
    # CUDA on entry, so that a process whose first case checkpoints (each probe of `fit --device cuda`) is not
    # sent to the CPU's operators
    import subprocess

    from tests_cuda_fake.test_predict_fake_cuda import ROOT

    code = ("from bench.analysis import predict; from bench.run.case import Case; "
            "(row,) = predict.predict_cases([Case('hf:tiny-llama:seq_len=16', 'checkpoint', 'train', 1, 'cuda', "
            "data='synthetic')]); print(row['engine'], row['message'])")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["fake-cuda"], done.stdout


def test_the_peak_by_category_on_cudas_operators_adds_up():
    # on fake CUDA Adam's step counts stay host tensors (not counted): its state is two blocks per weight's block
    row = hf_row("baseline")
    parts = [row[name] for name in ("predicted_weights_bytes", "predicted_grads_bytes",
                                    "predicted_optimizer_state_bytes", "predicted_activations_bytes",
                                    "predicted_logits_bytes", "predicted_other_bytes")]
    assert sum(parts) == row["predicted_bytes"]
    assert row["predicted_optimizer_state_bytes"] == 2 * row["predicted_weights_bytes"]
    assert row["predicted_logits_bytes"] >= 1 * 64 * 512 * 4  # batch x sequence x vocabulary floats
    assert row["predicted_other_bytes"] >= row["cublas_workspace_bytes"] > 0


def test_llama_8b_at_full_size_is_predicted_without_its_memory():
    # eval at a short sequence, to stay quick: every one of the 32 layers and the 8,030,261,248 published
    # parameters are counted (every tensor's float32 bytes a multiple of 512: no rounding), and this process grows
    # by far less than their 32 GB
    import resource

    from workloads.framework.hf_presets import PUBLISHED_PARAMETERS

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    (row,) = predict.predict_cases([Case("hf:llama-3.1-8b:seq_len=64", "baseline", "eval", 1, "cuda",
                                         data="synthetic")])
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert row["status"] == "ok" and row["engine"] == "fake-cuda", row
    assert row["predicted_weights_bytes"] == PUBLISHED_PARAMETERS["llama-3.1-8b"] * 4
    assert grown < 2 * 2**30, grown


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                    reason="torchao is not in this environment: `make cuda-fake-env` installs it (qlora's NF4 weights)")
def test_qlora_weights_are_nf4_storages_in_whole_allocator_blocks():
    # torchao's quantisation runs on the fake CUDA weights: each NF4 weight is five storages (codes, block scales,
    # their scales, a mean, the 16 levels), each rounded up to the allocator's 512 bytes. tiny-llama per layer, blocks
    # of 64 and scaler blocks of 8: q, o, k, v 5 x 512 each (their codes are 512 or 256 bytes); gate, up, down 1024
    # of codes + 4 x 512. Their float32 weights: q, o 4096 bytes, k, v 2048, gate, up, down 8192.
    lora, qlora = hf_row("lora:targets=all-linear"), hf_row("qlora:scaler_block=8")
    nf4 = 2 * (4 * 5 * 512 + 3 * (1024 + 4 * 512))
    dense = 2 * (2 * 4096 + 2 * 2048 + 3 * 8192)
    assert lora["predicted_weights_bytes"] - qlora["predicted_weights_bytes"] == dense - nf4 == 34816
    assert qlora["predicted_optimizer_state_bytes"] == lora["predicted_optimizer_state_bytes"]  # the same adapters
    assert qlora["predicted_bytes"] < lora["predicted_bytes"]
