"""Each step's batch from a host-memory DataLoader with `pin_memory=True`, copied with `non_blocking=True`."""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader

from strategies import Strategy, register_strategy


def _samples(inputs: Any, target: torch.Tensor) -> list[tuple[Any, torch.Tensor]]:
    """The batch as a dataset of single samples, which the DataLoader collates back into batches."""
    return [(tree_map(lambda t, i=i: t[i] if isinstance(t, torch.Tensor) else t, inputs), target[i])
            for i in range(target.shape[0])]


@register_strategy
class PinnedLoader(Strategy):
    """The batch comes from a `DataLoader` over host memory every step (the memory-saving article), as in a real loop,
    instead of sitting on the GPU from the start: collated in pinned (page-locked) memory and copied with
    `non_blocking=True`, so the copy is one DMA transfer the host need not wait for. `pin_memory=false` is the same
    loop from ordinary pageable memory, which the driver first copies into a pinned staging buffer: the
    comparison the technique is measured against. Device memory holds one more batch while it is copied; the
    saving is time. Exact (the same values); CUDA only (pinning needs a GPU): `unsupported` on the CPU.

    Limitations: the DataLoader collates in the training process (no worker processes), and its pinned host memory
    is not in `peak_mem_bytes` (device memory). The planner never tries it (`plan_excluded`).
    """

    name = "pinned_loader"
    description = "batch from a host DataLoader each step: pin_memory=True, non_blocking=True copies"
    devices = ("cuda",)
    options = {"pin_memory": True}
    plan_excluded = "changes where the batch comes from on the host, not the device's peak"

    def __init__(self, **options):
        super().__init__(**options)
        self.batches: Iterator | None = None

    def prepare_model(self, model, units):
        self.batches = None  # every session starts its loader afresh
        return model

    def load_batch(self, host_batch, device_batch):
        pin = self.settings["pin_memory"]
        if self.batches is None:
            inputs, target = host_batch
            loader = DataLoader(_samples(inputs, target), batch_size=target.shape[0], pin_memory=pin)
            self.batches = _forever(loader)
        inputs, target = next(self.batches)
        device = device_batch[1].device
        return tree_map(lambda t: t.to(device, non_blocking=pin) if isinstance(t, torch.Tensor) else t,
                        (inputs, target))


def _forever(loader: DataLoader) -> Iterator:
    while True:
        yield from loader
