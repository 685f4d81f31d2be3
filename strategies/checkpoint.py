"""Activation checkpointing over the workload's checkpoint units (checkpoint_sequential semantics), BatchNorm-safe."""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bench.errors import UsageError, Unsupported
from strategies.base import Strategy, register_strategy


def batchnorm_buffers(model: nn.Module) -> list[torch.Tensor]:
    """running_mean, running_var and num_batches_tracked of every BatchNorm in `model`."""
    return [b for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) for b in m.buffers()]


@contextlib.contextmanager
def preserved(buffers: list[torch.Tensor]):
    """Restores those of `buffers` that changed inside the block, on exit (also on an exception, e.g. checkpoint's
    early stop of a recompute). Only the changed ones: writing a buffer that a BatchNorm outside the recomputed
    segment saved for its backward would bump its version and make that backward fail. (Changes are found by
    value: the batch-norm kernel updates running statistics without bumping their version counter.)"""
    saved = [b.detach().clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, s in zip(buffers, saved):
                if not torch.equal(b, s):
                    b.copy_(s)


class UnitCheckpointer:
    """Checkpoints groups of a model's units in place, by replacing each group's `forward` (checkpoint_sequential
    semantics over any model: the units need not be the whole forward, only blocks that the model calls).

    A group of consecutive units that chain (the output of one is the input of the next and nothing else) is one
    checkpoint: its first unit runs the whole chain, the others pass their input through (checked: a model that
    does not feed them the chain's output raises). Units that do not chain are checkpointed one by one. Only in
    training with autograd on; otherwise the units run plainly.

    `bn_fix`: the recomputation in backward runs each BatchNorm's training-mode forward a second time, which would
    update running_mean/var again and count num_batches_tracked twice. With the fix, the recompute restores every
    BatchNorm buffer to what it was when the recompute began. `checkpoint_sequential` in this torch does not pass
    `context_fn` on, hence the segmenting here. Random state (dropout) is replayed by checkpoint itself
    (`preserve_rng_state`), so the recompute draws the same masks.
    """

    def __init__(self, model: nn.Module, reentrant: bool = False, bn_fix: bool = True):
        self.model = model
        self.reentrant = reentrant
        self.bn_fix = bn_fix
        self._bn_buffers = batchnorm_buffers(model) if bn_fix else []

    def _context_fn(self):
        return contextlib.nullcontext(), preserved(self._bn_buffers)

    def _reentrant_fn(self, function):
        calls = [0]  # the first call is the forward; any later one is the recompute in backward

        def run(*args):
            calls[0] += 1
            if calls[0] == 1 or not self.bn_fix:
                return function(*args)
            with preserved(self._bn_buffers):
                return function(*args)
        return run

    def checkpointed(self, function, *args, **kwargs):
        """`function(*args, **kwargs)`, its activations recomputed in backward (in training with autograd on)."""
        if not (self.model.training and torch.is_grad_enabled()):
            return function(*args, **kwargs)
        if self.reentrant:
            return checkpoint(self._reentrant_fn(function), *args, use_reentrant=True)
        if self.bn_fix:
            return checkpoint(function, *args, use_reentrant=False, context_fn=self._context_fn, **kwargs)
        return checkpoint(function, *args, use_reentrant=False, **kwargs)

    def install(self, group: list[nn.Module]) -> None:
        """Makes `group` (consecutive units that chain) one checkpoint."""
        forwards = [unit.forward for unit in group]
        last_output: list = [None]  # a weak reference to what the group's first unit returned

        def run_chain(*args, **kwargs):
            x = forwards[0](*args, **kwargs)
            for forward in forwards[1:]:
                x = forward(x)
            return x

        def first(*args, **kwargs):
            out = self.checkpointed(run_chain, *args, **kwargs)
            last_output[0] = weakref.ref(out) if isinstance(out, torch.Tensor) else None
            return out

        def passed_through(x, *rest, **kwargs):
            if rest or kwargs or last_output[0] is None or last_output[0]() is not x:
                raise RuntimeError("checkpoint units do not chain: a unit inside a checkpointed segment was not "
                                   "called with the previous unit's output (set the workload's units_chain = False)")
            return x

        group[0].forward = first
        for unit in group[1:]:
            unit.forward = passed_through


def segment_groups(units: list[nn.Module], segments: int, chain: bool) -> list[list[nn.Module]]:
    """checkpoint_sequential's plan: `segments` chunks of len(units) // segments units, all but the last
    checkpointed; a chunk is one checkpoint when its units chain, else each unit is its own."""
    size = len(units) // segments
    groups = [units[start:start + size] for start in range(0, size * (segments - 1), size)]
    return groups if chain else [[unit] for group in groups for unit in group]


@register_strategy
class Checkpoint(Strategy):
    """Activation checkpointing: keep only each segment's input, recompute the segment in backward.

    Options:
    - `segments` (default `auto`): how many chunks the workload's N checkpoint units are cut into, of `N // segments`
      units each; all but the last are checkpointed (the rest runs plainly). A number, or `auto` = min(6, N); the
      row's settings give the number used. More segments than units is an `unsupported` row. 6 was chosen on the
      captcha ResNet's 10 units (stem, 8 blocks, head). Evidence: train peak
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
    description = "activation checkpointing of the workload's checkpoint units (non-reentrant, BatchNorm statistics kept once)"
    options = {"segments": "auto", "reentrant": False, "bn_fix": True}
    auto_segments = 6
    priority = 30  # wraps the model after in-place ReLU changed it

    def __init__(self, **options):
        super().__init__(**options)
        segments = str(self.settings["segments"])
        if segments != "auto" and not (segments.isdigit() and int(segments) >= 1):
            raise UsageError(f"checkpoint:segments={segments} must be a positive integer or auto")
        self.segments_used: int | None = None

    def segments_for(self, units: int) -> int:
        """The number of segments over `units` checkpoint units."""
        segments = str(self.settings["segments"])
        return min(self.auto_segments, units) if segments == "auto" else int(segments)

    def prepare_model(self, model, units):
        workload = self.context.workload
        owner = f"workload {workload.spec()!r}" if workload is not None else "the model"
        segments = self.segments_for(len(units))
        if len(units) < 2:
            raise Unsupported(f"checkpoint needs at least 2 checkpoint units; {owner} names {len(units)}")
        if segments > len(units):
            raise Unsupported(f"checkpoint:segments={segments} exceeds the {len(units)} checkpoint units of {owner}")
        chain = workload.units_chain if workload is not None else True
        checkpointer = UnitCheckpointer(model, reentrant=self.settings["reentrant"], bn_fix=self.settings["bn_fix"])
        for group in segment_groups(list(units), segments, chain):
            checkpointer.install(group)
        self.segments_used = segments
        return model

    def describe(self):
        described = super().describe()
        if self.segments_used is not None:
            described["checkpoint.segments"] = self.segments_used
        return described
