"""The anchors' mechanisms on fake CUDA at small size: SDPA's kernel under a checkpoint's recomputation (autograd's
thread), and an anchor row end to end through the fake-CUDA worker, nvidia-smi's terms added to its reserved figure."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from bench.analysis import anchors, nvidia_smi
from bench.analysis import predict
from bench.measure.fake_cuda_mode import FakeAllocator, fake_cuda
from bench.measure.sdpa_kernel import SdpaKernelChoice
from bench.run.case import Case


def test_a_checkpoints_recomputation_runs_the_forwards_attention_kernel():
    """Autograd recomputes a checkpointed flash call on its own thread, where the torch-function mode is not: the
    kernel (and so the saved logsumexp and RNG state) must be the forward's, or the checkpoint refuses the step."""
    choice = SdpaKernelChoice((8, 0))
    before = (torch._C._get_sdp_priority_order(), torch.backends.cuda.cudnn_sdp_enabled())
    with fake_cuda(allocator=FakeAllocator(limit_bytes=2**40), inner=[choice]):
        q = torch.randn(1, 4, 64, 16, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = checkpoint(lambda x: F.scaled_dot_product_attention(x, x, x, dropout_p=0.1, is_causal=True), q,
                         use_reentrant=False)
        out.sum().backward()
    # the recomputation did not pass through the mode (another thread), yet ran flash: on the stubs' sm90 PyTorch
    # alone picks cuDNN, whose logsumexp and RNG state differ and make the checkpoint raise
    assert choice.kernels == ["flash"] and q.grad.shape == q.shape
    assert (torch._C._get_sdp_priority_order(), torch.backends.cuda.cudnn_sdp_enabled()) == before  # restored


def test_bf16_weights_with_checkpoint_is_predicted_on_fake_cuda_with_flash():
    step = predict.tracked_step(Case("hf:tiny-llama:seq_len=64", "bf16_weights+checkpoint", "train", 1, "cuda",
                                     data="synthetic"), "bf16_weights+checkpoint", engine="fake-cuda",
                                capability=(8, 0))
    assert step.sdpa_kernel == "flash" and step.peak_bytes > 0


def test_an_nvidia_smi_anchor_is_reserved_plus_the_context_through_the_worker(tmp_path):
    config = dict(__import__("workloads.framework.hf_presets", fromlist=["PRESETS"]).PRESETS["tiny-llama"])
    (tmp_path / "tiny.json").write_text(json.dumps(config))
    anchor = anchors.Anchor(name="tiny", source="test", source_ref="a/b/c@" + "0" * 40, label="tiny", figure=100.0,
                            unit="MiB", kind="nvidia_smi", gpu="A100 80GB", model=str(tmp_path / "tiny.json"),
                            strategy="baseline", seq_len=64, batch_size=1, configuration={"model": "tiny"},
                            process_baseline_bytes=600 * 2**20)
    row = anchors.anchor_row(anchor)
    assert row["status"] == "ok" and row["engine"] == "fake-cuda", row["message"]
    assert row["predicted_reserved_bytes"] >= row["predicted_allocated_bytes"] > 0
    assert row["predicted_bytes"] == row["predicted_reserved_bytes"] + nvidia_smi.context_term(600 * 2**20).bytes
    assert row["error_bytes"] == row["predicted_bytes"] - 100 * 2**20


def test_a_tensor_made_from_data_in_backward_stays_fake():
    """An optimizer step in a post-accumulate-grad hook runs on autograd's thread, where `torch.tensor(data,
    device="cuda")` (torchao's 8-bit quantisation map) must be lifted from the CPU as on the main thread, not
    copied to the stub CUDA device."""
    made = []
    with fake_cuda(allocator=FakeAllocator(limit_bytes=2**40)):
        weight = torch.randn(64, 64, device="cuda", requires_grad=True)
        weight.register_post_accumulate_grad_hook(
            lambda p: made.append(torch.tensor([0.5, -0.5], dtype=torch.float32, device="cuda")))
        (weight @ torch.randn(64, 4, device="cuda")).sum().backward()
    assert len(made) == 1 and made[0].device.type == "cuda" and made[0].shape == (2,)


@pytest.mark.parametrize("optimizer", ["optimizer:name=adamw8bit", "optimizer:name=adamw8bit:impl=bitsandbytes"])
def test_8bit_adamw_steps_in_backward_on_fake_cuda(optimizer):
    """torchtune's 8-bit AdamW in backward (torchao's, and bitsandbytes' as its README names it): each parameter's
    step in its hook, predicted on the fake-CUDA engine (no fallback), its 8-bit state the same bytes as the same
    optimizer stepped after backward, bar bitsandbytes' maps, which are per optimizer (one per parameter in backward,
    as torchtune makes them)."""
    def step(spec):
        return predict.tracked_step(Case("hf:tiny-llama:seq_len=32", spec, "train", 1, "cuda", data="synthetic"),
                                    spec, engine="fake-cuda", capability=(8, 0))

    in_backward = step(f"bf16_weights+{optimizer}+optimizer_in_backward")
    after = step(f"bf16_weights+{optimizer}")
    assert in_backward.engine == after.engine == "fake-cuda"
    # the state, made in the warm-up steps, is whole at both peaks; gradients are freed as they are applied
    # bitsandbytes: the embedding and the head (tiny-llama's only parameters of >= 4096 values) each in an optimizer
    # of its own in backward, each with its two 256-value float32 maps, where one optimizer after backward has one pair
    maps = 2 * 256 * 4 if "bitsandbytes" in optimizer else 0
    assert in_backward.peak_by_category["optimizer_state"] == after.peak_by_category["optimizer_state"] + maps > maps
    # bitsandbytes' update makes no temporaries, torchao's compiled one only its wrapper's buffers (strategies.
    # compiled_update), smaller at this size than the next forward's logits: both peaks are that forward's
    assert in_backward.peak_bytes == after.peak_bytes + maps and "grads" not in after.peak_by_category


def test_paged_8bit_state_is_unified_memory_outside_the_caching_allocator():
    """bitsandbytes' PagedAdamW8bit (torchtune's 8-bit row): the uint8 moments of a parameter of at least 100,000
    values are made with cudaMallocManaged, which `torch.cuda.memory_stats` never counts; a smaller parameter's state
    and the block scales stay in the caching allocator; the update is bitsandbytes' in-place kernel, which makes no
    temporaries. By hand: a 1024 x 1024 weight pages two 1 MiB code tensors; a 256 x 256 one (65,536 values) pages
    nothing."""
    from bench.core.memory_categories import UNIFIED_MEMORY
    from bench.measure import breakdown, cuda_allocator
    from strategies.optimizer import Optimizer

    def step(paged):
        allocator = FakeAllocator(limit_bytes=2**40)  # what torch.cuda.memory_allocated answers in a fake run
        with fake_cuda(allocator=allocator):
            tracker = breakdown.CategorizedTracker("cuda", record_events=True)
            with tracker:
                big = torch.zeros(1024, 1024, device="cuda", requires_grad=True)
                small = torch.zeros(256, 256, device="cuda", requires_grad=True)
                optimizer = Optimizer(name="adamw8bit", paged=paged).wrap_optimizer(
                    torch.optim.AdamW([big, small]), None)
                big.grad, small.grad = torch.ones_like(big), torch.ones_like(small)
                tracker.stage = "optimizer"
                optimizer.step()
                optimizer.step()  # the codes read again, outside the state's making
                live, counts = dict(tracker.live_by_category), (tracker.peak_bytes, tracker.live_bytes)
                live[UNIFIED_MEMORY + " (allocator)"] = allocator.live_bytes
            return live, cuda_allocator.replay(tracker.events, 0), counts

    (device_live, device, eager), (paged_live, paged, fused) = step(False), step(True)
    assert paged_live[UNIFIED_MEMORY] == 2 * 1024 * 1024 and UNIFIED_MEMORY not in device_live
    # the tracker still counts them as live tensors; the allocator's figures do not (its model, the fake allocator)
    allocator_paged, allocator_device = paged_live.pop(UNIFIED_MEMORY + " (allocator)"), device_live.pop(
        UNIFIED_MEMORY + " (allocator)")
    assert sum(paged_live.values()) == sum(device_live.values())
    assert allocator_device - allocator_paged == 2 * 1024 * 1024
    assert device.stats.allocated_bytes - paged.stats.allocated_bytes == 2 * 1024 * 1024
    # bitsandbytes' update is one kernel, in place: the step's peak is what it leaves (weights, gradients, state),
    # where torchao's arithmetic run eagerly makes float32 copies of the weight, gradient and moments
    assert fused[0] == fused[1] and paged.max_allocated_bytes == paged.stats.allocated_bytes
    assert eager[0] > eager[1] + 4 * 1024 * 1024


def test_bitsandbytes_adamw8bit_state_is_in_the_caching_allocator_and_paged_leaves_it():
    """bitsandbytes' AdamW8bit (impl=bitsandbytes, torchtune's README's `AdamW8bit`) makes its state with
    torch.zeros_like, in the caching allocator; PagedAdamW8bit (with paged=true) makes the codes of a parameter of at
    least 100,000 values with cudaMallocManaged. By hand: a 1024 x 1024 weight keeps 2 x 1 MiB of codes and 2 x 512
    float32 block maxima (one per 2048 values); a 256 x 256 one (65,536 values, never paged) 2 x 64 KiB of codes and
    2 x 32 maxima; the instance two 256-value float32 maps. The update is one in-place kernel: no temporaries."""
    from bench.core.memory_categories import UNIFIED_MEMORY
    from bench.measure import breakdown, cuda_allocator
    from strategies.optimizer import Optimizer

    def step(paged):
        allocator = FakeAllocator(limit_bytes=2**40)
        with fake_cuda(allocator=allocator):
            tracker = breakdown.CategorizedTracker("cuda", record_events=True)
            with tracker:
                big = torch.zeros(1024, 1024, device="cuda", requires_grad=True)
                small = torch.zeros(256, 256, device="cuda", requires_grad=True)
                optimizer = Optimizer(name="adamw8bit", impl="bitsandbytes", paged=paged).wrap_optimizer(
                    torch.optim.AdamW([big, small]), None)
                big.grad, small.grad = torch.ones_like(big), torch.ones_like(small)
                before = tracker.live_bytes
                tracker.stage = "optimizer"
                optimizer.step()
                optimizer.step()
                state, peak = tracker.live_bytes - before, tracker.peak_bytes - before
                live = dict(tracker.live_by_category)
            return state, peak, live, cuda_allocator.replay(tracker.events, 0)

    (state, peak, live, device), (paged_state, paged_peak, paged_live, paged) = step(False), step(True)
    by_hand = 2 * (1024 * 1024 + 512 * 4) + 2 * (65536 + 32 * 4) + 2 * 256 * 4
    assert state == peak == paged_state == paged_peak == by_hand, (state, peak, paged_state, paged_peak)
    assert UNIFIED_MEMORY not in live and paged_live[UNIFIED_MEMORY] == 2 * 1024 * 1024
    assert device.stats.allocated_bytes - paged.stats.allocated_bytes == 2 * 1024 * 1024
    assert device.max_allocated_bytes == device.stats.allocated_bytes  # the step's peak is what it leaves
