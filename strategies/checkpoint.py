"""Activation checkpointing over the model's stages (checkpoint_sequential semantics), BatchNorm-safe."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bench.errors import UsageError
from strategies.base import Strategy, register_strategy


def batchnorm_buffers(model: nn.Module) -> list[torch.Tensor]:
    """running_mean, running_var and num_batches_tracked of every BatchNorm in `model`."""
    return [b for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) for b in m.buffers()]


@contextlib.contextmanager
def preserved(buffers: list[torch.Tensor]):
    """Restores `buffers` on exit (also on an exception, e.g. checkpoint's early stop of a recompute)."""
    saved = [b.detach().clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, s in zip(buffers, saved):
                b.copy_(s)


class CheckpointedModel(nn.Module):
    """Runs `stages` in `segments` chunks, all but the last checkpointed (as `checkpoint_sequential` does).

    The original model stays a registered submodule, so `.parameters()`, `.train()`, `.eval()` and `state_dict`
    behave as before. In eval mode or with autograd off the stages run plainly.

    `bn_fix`: the recomputation in backward runs each BatchNorm's training-mode forward a second time, which would
    update running_mean/var again and count num_batches_tracked twice. With the fix, the recompute restores every
    BatchNorm buffer to what it was when the recompute began. `checkpoint_sequential` in this torch does not pass
    `context_fn` on, hence the segmenting here.
    """

    def __init__(self, model: nn.Module, stages: list[nn.Module], segments: int,
                 reentrant: bool = False, bn_fix: bool = True):
        super().__init__()
        if not 1 <= segments <= len(stages):
            raise UsageError(f"checkpoint:segments={segments} must be between 1 and the {len(stages)} stages")
        self.model = model
        self._stages = list(stages)  # a plain list: the stages' modules are already registered under `model`
        self.segments = segments
        self.reentrant = reentrant
        self.bn_fix = bn_fix
        self._bn_buffers = batchnorm_buffers(model) if bn_fix else []

    def _run(self, start: int, end: int):
        def run_segment(x):
            for stage in self._stages[start:end]:
                x = stage(x)
            return x
        return run_segment

    def _context_fn(self):
        return contextlib.nullcontext(), preserved(self._bn_buffers)

    def _reentrant_fn(self, function):
        calls = [0]  # the first call is the forward; any later one is the recompute in backward

        def run(x):
            calls[0] += 1
            if calls[0] == 1 or not self.bn_fix:
                return function(x)
            with preserved(self._bn_buffers):
                return function(x)
        return run

    def forward(self, x):
        n = len(self._stages)
        if not (self.training and torch.is_grad_enabled()):
            return self._run(0, n)(x)
        size = n // self.segments
        end = 0
        for start in range(0, size * (self.segments - 1), size):
            end = start + size
            function = self._run(start, end)
            if self.reentrant:
                x = checkpoint(self._reentrant_fn(function), x, use_reentrant=True)
            elif self.bn_fix:
                x = checkpoint(function, x, use_reentrant=False, context_fn=self._context_fn)
            else:
                x = checkpoint(function, x, use_reentrant=False)
        return self._run(end, n)(x)  # the last segment is never checkpointed: backward needs it at once


@register_strategy
class Checkpoint(Strategy):
    """Activation checkpointing: keep only each segment's input, recompute the segment in backward.

    Options:
    - `segments` (default 6): how many chunks the 10 stages (stem, 8 blocks, head) are cut into, of
      `10 // segments` stages each; all but the last are checkpointed (the rest runs plainly). Evidence: train peak
      of live tensor bytes at batch 8 on the CPU (exact tracker, synthetic data; baseline 221,420,444, of which
      ~180 MB are weights, gradients and Adam state, so only ~40 MB are activations to save):
        segments  1: 221,420,444 (nothing checkpointed)   2: 220,082,748   3: 212,546,108
        segments  4: 201,993,276 (6 stages recomputed)     5: 201,993,276 (8 recomputed)
        segments  6: 201,534,524 (5 stages recomputed: stem + 4 high-resolution blocks)
        segments 7..10: 201,534,524 (6..9 stages recomputed)
      6 gives the lowest peak seen with the fewest recomputed stages (the first, high-resolution stages hold most
      of the activations; checkpointing the later, small ones saves nothing more and costs recompute).
    - `reentrant` (default False) and `bn_fix` (default True) exist to demonstrate two traps, not for use:
      `reentrant=true` checkpoints with the reentrant autograd.Function, which, fed the batch (an input that does
      not require grad), returns an output that does not require grad, so the checkpointed segments' parameters
      get no gradient (verification shows params_without_grad > 0); `bn_fix=false` lets the recompute update the
      BatchNorm statistics a second time (verification shows bn_stats_match False).
    Exact: the recompute repeats the same fp32 arithmetic.
    """

    name = "checkpoint"
    description = "activation checkpointing of the model's stages (non-reentrant, BatchNorm statistics kept once)"
    options = {"segments": 6, "reentrant": False, "bn_fix": True}
    priority = 30  # wraps the model after in-place ReLU changed it

    def __init__(self, **options):
        super().__init__(**options)
        if self.settings["segments"] < 1:
            raise UsageError(f"checkpoint:segments={self.settings['segments']} must be at least 1")

    def prepare_model(self, model, stages):
        return CheckpointedModel(model, stages, self.settings["segments"],
                                 reentrant=self.settings["reentrant"], bn_fix=self.settings["bn_fix"])
