"""The published fine-tuning recipes' features on fake CUDA: activation offloading (`offload_activations`,
torchtune's kind), device bytes against hand-derived counts, alone and with each layer checkpointed; the kernel SDPA
picks for bf16 on sm80 and sm90, also in a checkpoint's recompute; packed rows.

Hand-derived: a chain of `exp` (each saves its output, E bytes) keeps every output on the device through the
forward; offloaded, only what Python still holds stays (and, with torchtune's streams, the last
`max_fwd_stash_size` offloaded outputs until backward begins)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from bench.analysis import predict
from bench.measure.fake_cuda_mode import FakeAllocator, fake_cuda
from bench.measure.sdpa_kernel import SdpaKernelChoice
from bench.run.case import Case
from strategies.offload import HostBytes
from strategies.offload_activations import OffloadedActivations

E = 64 * 64 * 4  # one float32 activation of the chain
LAYERS = 8


def _after_forward(hooks_of, checkpointed: bool = False) -> tuple[int, int, int]:
    """(device bytes live after the forward, host peak, host bytes live after backward) of an exp chain of LAYERS
    (checkpointed: each exp its own checkpoint) on fake CUDA under the hooks `hooks_of(host)` makes."""
    host = HostBytes()
    with fake_cuda(allocator=FakeAllocator(limit_bytes=2**40)):
        x = torch.randn(64, 64, device="cuda", requires_grad=True)
        before = torch.cuda.memory_allocated()
        with hooks_of(host):
            h = x
            for _ in range(LAYERS):
                h = checkpoint(torch.exp, h, use_reentrant=False) if checkpointed else h.exp()
        live = torch.cuda.memory_allocated() - before
        h.sum().backward()
        del h
        return live, host.peak_bytes, host.live_bytes


def test_offloaded_saved_activations_leave_the_device_by_their_bytes():
    nothing = _after_forward(lambda host: OffloadedActivations(host, min_offload_size=2**30))
    assert nothing == (LAYERS * E, 0, 0)  # every output saved on the device (the last one also held by `h`)
    single_stream = _after_forward(lambda host: OffloadedActivations(host, use_streams=False))
    assert single_stream == (1 * E, LAYERS * E, 0)  # only `h`; all eight copies on the host until backward
    streams = _after_forward(lambda host: OffloadedActivations(host, max_fwd_stash_size=5))
    assert streams == (5 * E, LAYERS * E, 0)  # outputs 4..8 stashed for the second stream's copies


def test_with_every_layer_checkpointed_only_the_layer_inputs_are_offloaded():
    # each checkpoint saves its input under the offloading hooks (x and the first seven outputs); what exp saves
    # inside goes to checkpoint's own hooks and is recomputed: the host holds the eight inputs, the device only
    # `h` (x is the caller's, outside the count)
    assert _after_forward(lambda host: OffloadedActivations(host, use_streams=False), checkpointed=True) == (
        1 * E, LAYERS * E, 0)


@pytest.mark.parametrize("capability,kernel", [((8, 0), "flash"), ((9, 0), "cudnn")])
def test_bf16_attention_runs_the_capabilitys_kernel_also_in_a_checkpoints_recompute(capability, kernel):
    # bf16 causal attention, head dim 64: flash on sm80; cuDNN first on sm90 (cuDNN > 9.15 in this torch). The
    # saved statistics are the logsumexp (batch x heads x sequence floats), never the probabilities; the recompute
    # in backward runs outside the mode and must pick the same kernel, or checkpoint stops on different metadata.
    b, h, s, d = 2, 4, 256, 64
    choice = SdpaKernelChoice(capability)
    with fake_cuda(allocator=FakeAllocator(limit_bytes=2**40), inner=[choice]):
        q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        before = torch.cuda.memory_allocated()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        saved = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
        logsumexp = b * h * s * 4
        # + the kernel's two RNG tensors (seed and offset, a 512-byte block each); no batch x heads x s x s matrix
        assert saved == logsumexp + 2 * 512
        out = checkpoint(lambda t: F.scaled_dot_product_attention(t, k, v, is_causal=True), q, use_reentrant=False)
        out.float().sum().backward()
    assert choice.kernels == [kernel, kernel]


def test_predict_bf16_with_every_layer_checkpointed_and_offloaded_on_an_a100():
    # torchtune's recipe at small size: bf16 weights, every decoder layer checkpointed, activations offloaded, on
    # compute capability 8.0: flash attention, its recompute in backward too (it fell back to the CPU's operators
    # before: "Recomputed values ... have different metadata"), the layers' bf16 inputs on the host
    pytest.importorskip("transformers")
    spec = "bf16_weights+checkpoint:segments=all+offload_activations"
    row = predict.predict_case(Case("hf:tiny-llama:seq_len=64", spec, "train", 2, "cuda", data="synthetic"),
                               capability=(8, 0))
    assert row["status"] == "ok" and row["engine"] == "fake-cuda" and "failed" not in row["message"], row
    assert row["recompute_plan"] == "0 1" and row["sdpa_kernel"] == "flash"
    assert row["offload_host_peak_bytes"] >= 2 * 2 * 64 * 32 * 2  # the two layers' inputs at least


def test_predict_a_packed_row_runs_the_masked_kernel_and_says_what_it_does_not_trace():
    # packed rows give SDPA transformers' block-diagonal mask: flash takes no mask, so bf16 on sm80 runs the
    # memory-efficient kernel; torchtune packs with FlexAttention's block mask instead, which the row names
    pytest.importorskip("transformers")
    row = predict.predict_case(Case("hf:tiny-llama:seq_len=64:packed=4", "bf16_weights", "train", 2, "cuda",
                                    data="synthetic"), capability=(8, 0))
    assert row["status"] == "ok" and row["engine"] == "fake-cuda", row
    assert row["sdpa_kernel"] == "efficient" and "FlexAttention" in row["message"], row
