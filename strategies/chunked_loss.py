"""The output head and the cross-entropy over chunks of tokens: the whole float32 logits never exist (Liger-style).

A language model's last Linear maps every token's hidden state to the vocabulary: batch x sequence x vocabulary
logits, float32 for the loss, often the largest tensor of a training step (gpt2's 50,257-word vocabulary at
sequence 1024 is 206 MB per sequence, and the cross-entropy keeps its log-softmax as large again). This strategy
runs the model without its head; the loss then applies the head and the cross-entropy to K chunks of tokens, each
chunk under `torch.utils.checkpoint`, so that only its hidden states are kept and its logits are recomputed in
backward. The peak holds one chunk's logits (and their gradient) instead of the whole.

Example: `python -m bench compare --workload hf:gpt2:layers=2:seq_len=256 --strategies chunked_loss,
chunked_loss:chunks=16+checkpoint --device cpu --batch-size 2 --quick --phases train`.

Limitations: the workload must declare its head (`Workload.output_head`, `hidden_states`; gpt_mini and the `hf:`
causal LMs do); masked LM and sequence classification have none here, and other workloads are `unsupported`. Train
phase only: in eval there is no backward, so nothing is saved that chunking could drop. Under autocast the head
runs in autocast's dtype as in the baseline's forward. The sum over tokens is split into K partial sums (the loss,
the head's weight gradient), so results agree with the baseline to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from bench.core.errors import Unsupported, UsageError
from strategies import MATCHES, Strategy, Tolerance, register_strategy, unsupported


IGNORE_INDEX = -100  # the target of a token without a loss (F.cross_entropy's default, transformers' label)


def _inputs_of(args: tuple, kwargs: dict):
    """A batch's inputs as `Workload.run_model` passed them: keyword arguments (a dict), one tensor, or a tuple."""
    if kwargs:
        return kwargs
    return args[0] if len(args) == 1 else args


class HeadlessModel(nn.Module):
    """`model` run without its output head: it returns the workload's `DeferredHead`, whose loss applies the head
    by chunks."""

    def __init__(self, model: nn.Module, workload, head: nn.Linear, chunks: int):
        super().__init__()
        self.model = model
        self.head = head  # also a submodule of `model`: parameters() yields it once
        self.workload = workload
        self.chunks = chunks

    def forward(self, *args, **kwargs):
        hidden = self.workload.hidden_states(self.model, _inputs_of(args, kwargs))
        # the head runs where the loss runs (outside the strategies' forward contexts), so the autocast state the
        # baseline's head ran under is taken here and re-entered around each chunk's head
        device_type = hidden.device.type
        autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        return self.workload.deferred_head(
            hidden, lambda h, target: self.chunked_cross_entropy(h, target, device_type, *autocast))

    def chunked_cross_entropy(self, hidden: torch.Tensor, target: torch.Tensor, device_type: str,
                              autocast_enabled: bool, autocast_dtype: torch.dtype) -> torch.Tensor:
        """The mean token cross-entropy of `head(hidden)` against `target`, summed chunk by chunk."""
        head = self.head

        def chunk_loss_sum(hidden_chunk: torch.Tensor, target_chunk: torch.Tensor) -> torch.Tensor:
            with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_enabled):
                logits = head(hidden_chunk)
            return F.cross_entropy(logits.float(), target_chunk, ignore_index=IGNORE_INDEX, reduction="sum")

        tokens = hidden.reshape(-1, hidden.shape[-1])
        targets = target.reshape(-1)
        size = math.ceil(targets.numel() / self.chunks)
        # torch.split, not one narrow per chunk: its backward is one node that concatenates the chunks' gradients,
        # where each narrow's backward would allocate a zero gradient of the whole hidden states
        total = None
        for hidden_chunk, target_chunk in zip(torch.split(tokens, size), torch.split(targets, size)):
            if torch.is_grad_enabled():
                # no random numbers in a head and a cross-entropy: no RNG state to keep for the recompute
                part = checkpoint(chunk_loss_sum, hidden_chunk, target_chunk, use_reentrant=False,
                                  preserve_rng_state=False)
            else:
                part = chunk_loss_sum(hidden_chunk, target_chunk)
            total = part if total is None else total + part
        # F.cross_entropy's mean: over the targets that count (NaN when none does, as the baseline's)
        return total / (targets != IGNORE_INDEX).sum()


@register_strategy
class ChunkedLoss(Strategy):
    """The output head and the cross-entropy over `chunks` chunks of tokens, each recomputed in backward."""

    name = "chunked_loss"
    keeps_training_state = True
    description = ("output head + cross-entropy over K chunks of tokens, each chunk's logits recomputed in backward "
                   "(the whole logits never exist)")
    phases = ("train",)
    options = {"chunks": 8}

    # Loss and gradients within float32 rounding (EXACT's loss_rtol and grad_rtol; measured ~1e-7). The weights
    # after Adam's first step are not: Adam divides each gradient by its magnitude (plus eps 1e-8), and a gradient
    # that is zero in exact arithmetic (the attention's key bias: softmax ignores a shift shared by every key) is
    # rounding noise of ~1e-11 whose size and sign follow the order of the sums. Measured: 2.6e-4 on gpt_mini's
    # qkv bias with chunks=5, 2.2e-4 on hf:tiny-gpt2's with chunks=3.
    tolerance = Tolerance(step_rtol=1e-3)
    priority = 70  # wraps the model last: the other transforms (checkpointing its layers) apply to the model inside
    # run and its memory pinned on gpt_mini and hf:tiny-gpt2 in tests/test_chunked_loss.py
    expected = unsupported("has no separable output head")
    expected_with = {"output_head": MATCHES}
    refusals = (r"has no separable output head",)

    def __init__(self, **options):
        super().__init__(**options)
        if self.settings["chunks"] < 1:
            raise UsageError(f"chunked_loss:chunks={self.settings['chunks']} must be at least 1")

    def check(self, context) -> None:
        # the workload first: a model without a head is unsupported in either phase, for that reason
        workload = context.workload
        if workload is not None and not workload.has_output_head():
            raise Unsupported(f"chunked_loss has nothing to chunk in {context.phase}: {self.model_owner()} has no "
                              "separable output head (a final Linear to a vocabulary under a token cross-entropy, "
                              "declared by Workload.output_head)")
        super().check(context)

    def prepare_model(self, model: nn.Module, units: list[nn.Module]) -> nn.Module:
        head = self.context.workload.output_head(model)
        if head is None:
            raise Unsupported(f"chunked_loss has nothing to chunk in {self.context.phase}: {self.model_owner()} has no "
                              "separable output head")
        return HeadlessModel(model, self.context.workload, head, self.settings["chunks"])
