"""Validation under `torch.no_grad()`: no autograd graph, so no activation is kept for a backward that never comes."""

import torch

from strategies.base import Strategy, register_strategy


@register_strategy
class NoGradEval(Strategy):
    """The eval forward inside `torch.no_grad()`. Exact; eval only (in train it is an `unsupported` row)."""

    name = "no_grad_eval"
    description = "validation forward inside torch.no_grad(): no autograd graph is built"
    phases = ("eval",)
    priority = 35

    @classmethod
    def plan_options(cls, space):
        """One setting, the defaults: nothing to search."""
        return [{}]

    def forward(self):
        return torch.no_grad()
