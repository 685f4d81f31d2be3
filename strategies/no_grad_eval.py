"""Validation under `torch.no_grad()`: no autograd graph, so no activation is kept for a backward that never comes."""

import torch

from strategies import Strategy, register_strategy


@register_strategy
class NoGradEval(Strategy):
    """The eval forward inside `torch.no_grad()`. Exact; eval only (in train it is an `unsupported` row)."""

    name = "no_grad_eval"
    description = "validation forward inside torch.no_grad(): no autograd graph is built"
    phases = ("eval",)
    priority = 35
    # Eval 143,910,368 -> 56,157,664 (0.390) on captcha_resnet18: weights plus one layer's transients.
    memory_effect = {"eval": (0.3, 0.5)}

    def forward(self):
        return torch.no_grad()
