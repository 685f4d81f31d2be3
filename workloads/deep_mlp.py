"""The very deep MLP of the memory-saving article: `layers` Linear(width, width) in one nn.Sequential, no activation.

The article builds `nn.Sequential(*[nn.Linear(10, 10) for _ in range(1000)])` to show that checkpointing a model
of many small layers trades recompute for the activations each layer saves. Here:

- Batch 256 by default, where the article feeds a batch of 1. Each Linear saves its input for backward, so the
  activations are `layers * batch * width * 4` bytes: 10.2 MB at the defaults, against 1.76 MB of weights,
  gradients and Adam state (110,000 parameters). At batch 1 the activations (40 KB) would vanish under the
  parameters and checkpointing would have nothing visible to save.
- Orthogonal weights and zero biases. PyTorch's default init scales each layer by about 1/sqrt(3), so after
  1000 layers the backward signal underflows to exactly 0 in float32: 836 of the 1000 layers get all-zero weight
  gradients, so a strategy that lost their gradients (the reentrant-checkpoint trap) would still match the baseline.
  An orthogonal matrix keeps the norm of both the forward signal and the backward gradient, so every layer's
  gradient is of the same order at any depth.
- Adam with PyTorch's defaults (the base class's optimizer, as the article's loop); its two state tensors per
  parameter are part of what the peak holds.
- Synthetic data only: standard-normal inputs and regression targets, MSE loss.
"""

from __future__ import annotations

import torch
from torch import nn

from workloads import Workload, register_workload


@register_workload
class DeepMLPWorkload(Workload):
    """Article 002's deep MLP: `layers` x Linear(width, width), MSE against a random target, Adam, batch 256."""

    name = "deep_mlp"
    description = "deep MLP of article 002 (1000 x Linear(10, 10), no activation), MSE, Adam"
    default_batch_size = 256
    seed = 0
    data_sources = ("synthetic",)
    options = {"layers": 1000, "width": 10}
    small = ("deep_mlp:layers=24:width=8", 8)
    small_for = {"loop": ("deep_mlp:layers=24:width=8", 64),  # batch 64: the peak falls in backward
                 "peak_in_backward": ("deep_mlp:layers=24:width=8", 64),
                 "emulated16": ("deep_mlp:layers=24:width=8", 2),
                 "fake_cuda": ("deep_mlp:layers=3:width=8", 2)}  # a fake operator costs the same at any size

    def configure(self) -> None:
        self.require_positive("layers", "width")

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        width = self.settings["width"]
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(self.settings["layers"])])
        with torch.no_grad():
            for layer in model:
                nn.init.orthogonal_(layer.weight)
                nn.init.zeros_(layer.bias)
        return model

    def make_batch(self, batch_size: int, data: str = "synthetic") -> tuple[torch.Tensor, torch.Tensor]:
        self.check_data(data)
        gen = torch.Generator().manual_seed(self.seed)
        shape = (batch_size, self.settings["width"])
        return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)
