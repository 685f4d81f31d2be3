"""The workload interface: a model, its data, loss and optimizer, with defaults as class attributes."""

from __future__ import annotations

import torch
from torch import nn

from bench.registry import Registry

WORKLOADS: Registry[type["Workload"]] = Registry("workload")
register_workload = WORKLOADS.register


class Workload:
    """One trainable model and the data it is trained on (the TorchBench `models/<name>` pattern)."""

    name = ""
    description = ""
    default_batch_size = 100
    seed = 0
    data_sources = ("captcha", "synthetic")

    def build_model(self) -> nn.Module:
        """The model with weights from `seed`, on the CPU."""
        raise NotImplementedError

    def stages(self, model: nn.Module) -> list[nn.Module]:
        """The model as an ordered list of modules whose chained calls equal `model(x)` (for checkpointing)."""
        raise NotImplementedError

    def loss_fn(self) -> nn.Module:
        """The training loss, called as `loss_fn(output, target)`."""
        raise NotImplementedError

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer over `model`'s parameters."""
        raise NotImplementedError

    def make_batch(self, batch_size: int, data: str = "captcha") -> tuple[torch.Tensor, torch.Tensor]:
        """One (input, target) batch on the CPU, the same for the same `batch_size`, `data` and `seed`."""
        raise NotImplementedError
