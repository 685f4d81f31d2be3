"""The `hf:` workload's `loss=shifted`: a causal LM's loss as transformers computed it before 4.46 and training
scripts of 2022 wrote it (ColossalAI's GPTLMLoss), in the logits' own dtype over a shifted contiguous copy, the
logits dropped before the backward. Checked against the source's own code run for real on the CPU, byte for byte
(the live-tensor tracker), and against membench's default float32 loss, which holds a float32 log-softmax and its
two gradients (a 16-bit model's loss was predicted at 7 copies of its logits where the source's step holds 3).

Small: a two-layer GPT-2 of width 32 and a 512-word vocabulary (its logits are most of its step), 64 tokens.
"""

import importlib.util

import pytest
import torch
from torch import nn

from bench.analysis import fake_engine
from bench.core.errors import UsageError
from bench.measure.memory import LiveTensorTracker
from bench.run.case import Case, bind_case
from bench.run.runner import memory_pass
from workloads import to_float32
from workloads.framework.loader import resolve_workload

needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                              reason="transformers is not installed (make install installs membench[hf])")
pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = "hf:tiny-gpt2:seq_len=64"
BATCH = 4


class GPTLMLoss(nn.Module):
    """ColossalAI-Pytorch-lightning's benchmark/gpt/model.py (6a82b80, August 2022), as it is written there."""

    def __init__(self):
        super().__init__()
        self.loss = nn.CrossEntropyLoss()

    def forward(self, logits, labels):
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        return self.loss(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))


def bf16_model(workload):
    model = workload.build_model().to(torch.bfloat16)  # DeepSpeed's fp16 section casts the module: 16-bit logits
    model.train()
    return model


def tracked(step) -> tuple[int, torch.Tensor]:
    """(the peak of live tensor bytes while `step()` runs its forward, loss and backward, the loss)."""
    torch.manual_seed(1)  # the same dropout in every step
    with LiveTensorTracker() as tracker:
        loss = step()
    return tracker.peak_bytes, loss.detach().float()


def membench_step(workload, model, inputs, target):
    """The session's step (bench.run.session): the output converted to float32, the workload's loss, backward."""
    def step():
        predicted = workload.run_model(model, inputs)
        loss = workload.loss(to_float32(predicted), target)
        loss.backward()
        return loss
    return step


def source_step(model, input_ids, labels):
    """The source's: Lightning's training_step returns the loss (its `logits` dropped), then the backward. Its
    labels are its input ids; here the batch's `labels`, their copy (as a data collator makes them), so that both
    steps read the same tensors."""
    criterion = GPTLMLoss()

    def training_step():
        logits = model(input_ids=input_ids)[0]
        return criterion(logits, labels)

    def step():
        loss = training_step()
        loss.backward()
        return loss
    return step


@needs_hf
def test_shifted_loss_holds_what_the_sources_own_loss_holds_to_the_byte():
    shifted = resolve_workload(f"{SPEC}:loss=shifted")
    inputs, target = shifted.make_batch(BATCH, "synthetic")
    assert set(inputs) == {"input_ids", "labels"} and torch.equal(inputs["labels"], inputs["input_ids"])
    source_peak, source_loss = tracked(source_step(bf16_model(shifted), inputs["input_ids"], inputs["labels"]))
    peak, loss = tracked(membench_step(shifted, bf16_model(shifted), inputs, target))
    assert peak == source_peak
    torch.testing.assert_close(loss, source_loss, rtol=0, atol=0)


@needs_hf
def test_the_float32_loss_holds_three_more_logits_copies_than_the_16_bit_one():
    """The default (the loss in float32, as transformers computes it since 4.46): the step's peak is at the
    log-softmax's backward, its saved output, its output's gradient and its input's, float32 each: 6 copies of the
    16-bit logits, and the 16-bit logits the loop still holds; the 16-bit loss holds 3 (its saved output and the two
    gradients) and drops the logits."""
    default, shifted = resolve_workload(SPEC), resolve_workload(f"{SPEC}:loss=shifted")
    inputs, target = default.make_batch(BATCH, "synthetic")
    logits_bytes = BATCH * 64 * default.config().vocab_size * torch.bfloat16.itemsize
    float32_peak, _ = tracked(membench_step(default, bf16_model(default), inputs, target))
    inputs, target = shifted.make_batch(BATCH, "synthetic")
    bf16_peak, _ = tracked(membench_step(shifted, bf16_model(shifted), inputs, target))
    assert 3.5 * logits_bytes < float32_peak - bf16_peak < 4.5 * logits_bytes


@needs_hf
def test_the_fake_engine_predicts_the_shifted_loss_to_the_byte():
    case = Case(f"{SPEC}:loss=shifted", "bf16_weights", "train", 2, "cpu", data="synthetic", warmup=0, steps=1)
    measured = memory_pass(case, bind_case(case)[0])["peak_mem_bytes"]
    assert fake_engine.tracked_peak(case, "bf16_weights", engine="fake", block_bytes=1) == measured


@needs_hf
def test_shifted_is_a_causal_lms_loss():
    with pytest.raises(UsageError, match="loss=shifted is a causal LM's loss.*valid choices: logits, model"):
        resolve_workload("hf:tiny-bert:seq_len=8:loss=shifted")
    assert not resolve_workload(f"{SPEC}:loss=shifted").has_output_head()
