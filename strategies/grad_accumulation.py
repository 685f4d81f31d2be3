"""Gradient accumulation: one step's batch run forward and backward in K micro-batches, then one optimizer step."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from bench.core.errors import Unsupported, UsageError
from strategies import Strategy, differs, register_strategy


def batch_statistics_modules(model: nn.Module) -> list[str]:
    """What in `model`'s training forward depends on how the batch is split: BatchNorm, dropout with p > 0."""
    found = []
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        found.append("BatchNorm")
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        found.append("dropout")
    return found


@register_strategy
class GradAccumulation(Strategy):
    """The batch of N in K micro-batches of N/K: each micro-batch's loss is scaled by 1/K before its backward, the
    gradients add up in `.grad`, and one optimizer step follows. The activations alive at once are one
    micro-batch's, so the activation part of the peak falls about K-fold; weights, gradients and optimizer state do
    not change, and K smaller matrix products cost time.

    The 1/K scaling gives the full batch's gradient for a loss that is a mean over the batch (every built-in
    workload's). Without BatchNorm or dropout the result is the baseline's to float tolerance (sums in another
    order). BatchNorm normalises each micro-batch by that micro-batch's statistics, and updates its running
    statistics K times; dropout draws other masks: the row then says it does not match the baseline, and why.
    A batch that K does not divide is an `unsupported` row (a sweep over batch sizes goes on).

    Limitations: BatchNorm and dropout make it differ by design (above). The 1/K scaling is the full batch's
    gradient only for a loss that is a mean over the batch's samples: a loss averaged over another count that varies
    between micro-batches (tokens whose targets are ignored) weighs the micro-batches equally, not by that count. A
    batch that K does not divide, or whose tensors do not all have the batch as their first dimension, is an
    `unsupported` row.
    """

    name = "grad_accumulation"
    keeps_training_state = True
    description = "the batch in K micro-batches, gradients accumulated, one optimizer step"
    phases = ("train",)
    options = {"micro_batches": 2}
    priority = 55

    # 2 and 4 micro-batches of the same batch (the same effective batch); check() drops a count that does not divide it
    plan_options = ({"micro_batches": 2}, {"micro_batches": 4})
    # BatchNorm sees each micro-batch apart, dropout draws its masks per micro-batch (tests/test_training_loop.py)
    expected_with = {"batch_norm": differs("BatchNorm normalises each of the 2 micro-batches"),
                     "dropout": differs("dropout draws its masks per micro-batch")}

    def __init__(self, **options):
        super().__init__(**options)
        if self.settings["micro_batches"] < 1:
            raise UsageError(f"grad_accumulation:micro_batches={self.settings['micro_batches']} must be at least 1")
        self.split_changes: list[str] = []

    def check(self, context):
        super().check(context)
        count, batch = self.settings["micro_batches"], context.batch_size
        if batch is not None and batch % count:
            raise Unsupported(f"grad_accumulation:micro_batches={count} needs a batch size divisible by {count}, "
                              f"not {batch}")

    def prepare_model(self, model, units):
        self.split_changes = batch_statistics_modules(model)
        return model

    def micro_batches(self, inputs, target):
        count = self.settings["micro_batches"]
        batch = target.shape[0]
        for tensor in tree_flatten((inputs, target))[0]:
            if tensor.shape[:1] != (batch,):
                raise Unsupported(f"grad_accumulation cannot split a batch whose tensors do not all have the batch "
                                  f"({batch}) as their first dimension")
        size = batch // count
        def piece(value, i):
            return value[i * size:(i + 1) * size] if isinstance(value, torch.Tensor) else value

        return [(tree_map(lambda v: piece(v, i), inputs), piece(target, i), 1 / count) for i in range(count)]

    def differs_by_design(self):
        count = self.settings["micro_batches"]
        if count == 1:
            return None
        why = {"BatchNorm": f"BatchNorm normalises each of the {count} micro-batches by its own statistics and "
                            f"updates its running statistics {count} times",
               "dropout": "dropout draws its masks per micro-batch"}
        return "; ".join(why[found] for found in self.split_changes) or None
