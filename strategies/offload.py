"""CPU offload of activations: tensors saved for backward are copied to (pinned) host memory during the forward.

`torch.autograd.graph.save_on_cpu(pin_memory=True)` around the forward: each tensor autograd saves is copied to
host memory as it is saved and copied back when the backward needs it, so the GPU holds only the activations in
flight. It costs two transfers per saved tensor (device to host in the forward, host to device in backward) and
host memory as large as the activations it moves. On the CPU the "host" is the device itself: the copies save
nothing, so it is CUDA only.
"""

from __future__ import annotations

import contextlib

import torch

from bench.core.errors import Unsupported
from strategies import Strategy, register_strategy


class HostBytes:
    """Live and peak bytes of the host copies a `save_on_cpu` context has made (each counted until autograd
    releases it)."""

    def __init__(self):
        self.live_bytes = 0
        self.peak_bytes = 0

    def add(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def free(self, nbytes: int) -> None:
        self.live_bytes -= nbytes


class _CountedCopy:
    """One packed saved tensor: `save_on_cpu`'s (device, host copy), its bytes counted while autograd holds it."""

    def __init__(self, packed, host: HostBytes):
        self.packed = packed
        self.nbytes = packed[1].untyped_storage().nbytes()
        self.host = host
        host.add(self.nbytes)

    def __del__(self):
        self.host.free(self.nbytes)


def counted_save_on_cpu(host: HostBytes, pin_memory: bool) -> torch.autograd.graph.save_on_cpu:
    """`save_on_cpu(pin_memory)` whose hooks also count the host copies it holds into `host`."""
    hooks = torch.autograd.graph.save_on_cpu(pin_memory=pin_memory)
    pack, unpack = hooks.pack_hook, hooks.unpack_hook
    hooks.pack_hook = lambda tensor: _CountedCopy(pack(tensor), host)
    hooks.unpack_hook = lambda counted: unpack(counted.packed)
    return hooks


@register_strategy
class Offload(Strategy):
    """`save_on_cpu(pin_memory=True)` around the forward; the row's `offload_host_peak_bytes` is the most host
    memory its copies held at once (in the measured step of the memory pass, or the last step that ran).
    Exact: the saved values come back unchanged.

    Limitations: CUDA only. `save_on_cpu` moves every saved tensor, parameters included: a weight that a Linear
    saves comes back in backward as a second device copy (`offload_activations` leaves parameters where they are).
    The host copies are not in `peak_mem_bytes` (device memory): they are `offload_host_peak_bytes`."""

    name = "offload"
    keeps_training_state = True
    row_columns = ("offload_host_peak_bytes",)
    description = "activations saved for backward kept in pinned host memory (save_on_cpu), CUDA only"
    phases = ("train",)
    devices = ("cuda",)
    priority = 35  # inside checkpoint's patching, outside autocast: it sees what autocast saves

    def __init__(self, **options):
        super().__init__(**options)
        self.host = HostBytes()

    def check(self, context):
        if context.device not in self.devices:  # the device first: on the CPU no phase would help
            raise Unsupported(f"offload needs device cuda, not {context.device}: on the CPU the host is the device, "
                              "so the copies save nothing")
        super().check(context)

    @contextlib.contextmanager
    def forward(self):
        self.host = HostBytes()  # one step's copies: the last forward's figure is the row's
        with counted_save_on_cpu(self.host, pin_memory=True):
            yield

    def columns(self):
        return {"offload_host_peak_bytes": self.host.peak_bytes}
