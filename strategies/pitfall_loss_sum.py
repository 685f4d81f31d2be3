"""Pitfall: the loop sums the loss tensor across steps (`total += loss`) instead of `loss.item()`."""

from __future__ import annotations

import torch

from strategies import Strategy, register_strategy


@register_strategy
class PitfallLossSum(Strategy):
    """`total_loss += loss` keeps each step's loss, with its autograd graph, referenced from the running total.

    In eval with autograd on (the article's validation loop), nothing ever frees a batch's graph: every batch's
    saved activations stay alive, and memory grows by one forward's activations per step
    (`mem_growth_bytes_per_step`) until the loop ends or the memory runs out. In training, `backward()` has freed
    the saved tensors already: what grows is the chain of autograd nodes, host memory that the tensor count does
    not see, so its growth column reads 0. The fix: `total += loss.item()` (or `loss.detach()`). The same
    arithmetic: it matches the baseline.

    Limitations: in training its growth is not counted: it is host memory of autograd nodes, which the tensor count
    does not see, so `mem_growth_bytes_per_step` reads 0 there (above).
    """

    name = "pitfall_loss_sum"
    pitfall = True
    description = "total += loss across steps (not loss.item()): every step's graph stays referenced"
    priority = 70
    # Train 221,420,448 on captcha_resnet18 (+4 bytes: the running total); eval grows by one forward per step
    # (tests/test_training_loop.py)
    memory_effect = {}  # no band on captcha_resnet18: see above

    def __init__(self, **options):
        super().__init__(**options)
        self.total: torch.Tensor | float = 0.0

    def prepare_model(self, model, units):
        self.total = 0.0  # every session's loop starts its own total
        return model

    def accumulate_loss(self, loss_of_step):
        self.total = self.total + loss_of_step()
