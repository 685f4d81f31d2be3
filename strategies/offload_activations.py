"""Activation offloading as torchtune does it (`OffloadActivations`): saved activations to pinned host memory.

torchtune's `training.OffloadActivations` is a `saved_tensors_hooks` context around the model's forward: each tensor
autograd saves that is at least `min_offload_size` bytes (1024) and is not a parameter is copied to pinned host
memory in the forward, and copied back to the device when backward needs it; smaller ones and parameters stay where
they are. `get_act_offloading_ctx_manager` opts the output head (`lm_head`) out (its input would come straight back).
With `use_streams` (torchtune's default) the copies run on a second stream, and two stashes keep device tensors alive
longer than the copy needs: the forward keeps each offloaded activation until `max_fwd_stash_size` more tensors have
been saved (and the last ones until backward starts), backward keeps each tensor brought back until it has moved on
to another autograd node. Those lifetimes are the device memory this strategy costs; they are kept here as
torchtune keeps them (the streams' events order the copies, which a fake step has none of). `use_streams=false` is
torchtune's single-stream path: no stash.

Composed with `checkpoint` (torchtune's activation checkpointing plus offloading), only what autograd saves outside
the checkpoints is offloaded: each checkpointed layer's input (non-reentrant checkpoint saves it under the hooks
around it, while the layer's own saved tensors go to checkpoint's hooks), the embedding's and the final norm's.

Where `offload` (`save_on_cpu`) moves every saved tensor, parameters included (a weight saved by a Linear comes
back as a second device copy in backward), this moves the activations only. CUDA only: on the CPU the host is the
device. The row's `offload_host_peak_bytes` is the most host memory the copies held at once. Exact: the values come
back unchanged.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from bench.core.errors import Unsupported, UsageError
from strategies import Strategy, register_strategy
from strategies.offload import HostBytes


class OffloadedActivations(saved_tensors_hooks):
    """torchtune's pack and unpack hooks, their host copies counted in `host` (see the module docstring)."""

    def __init__(self, host: HostBytes, min_offload_size: int = 1024, max_fwd_stash_size: int = 5,
                 use_streams: bool = True, pin_memory: bool = True):
        self.host, self.min_bytes, self.pin_memory = host, min_offload_size, pin_memory
        self.stash_size = max_fwd_stash_size if use_streams else 0
        self.saved: dict[int, tuple[torch.Tensor, bool]] = {}  # id -> (host copy, True) or (the tensor, False)
        self.forward_stash: dict[int, torch.Tensor] = {}  # id -> offloaded device tensor kept alive
        self.backward_stash: dict[int, torch.Tensor] = {}  # id -> device copy brought back, kept alive
        self.last_id = 0
        self.node = None  # the autograd node of the last unpack
        self.in_backward = False
        super().__init__(self.pack, self.unpack)

    def pack(self, activation: torch.Tensor) -> int:
        self.in_backward = False
        self.last_id += 1
        tensor_id = self.last_id
        nbytes = activation.element_size() * activation.nelement()
        if nbytes < self.min_bytes or isinstance(activation, nn.Parameter):
            self.saved[tensor_id] = (activation, False)
            return tensor_id
        for old in [k for k in self.forward_stash if k <= tensor_id - self.stash_size]:
            del self.forward_stash[old]
        host_copy = torch.empty_like(activation, pin_memory=self.pin_memory, device="cpu")
        host_copy.copy_(activation, non_blocking=True)
        self.host.add(host_copy.untyped_storage().nbytes())
        self.saved[tensor_id] = (host_copy, True)
        if self.stash_size:
            self.forward_stash[tensor_id] = activation
        return tensor_id

    def unpack(self, tensor_id: int) -> torch.Tensor:
        if not self.in_backward:
            self.in_backward = True
            if self.stash_size:  # torchtune's callback at the end of backward frees what it still holds
                torch.autograd.Variable._execution_engine.queue_callback(self.backward_stash.clear)
        tensor, offloaded = self.saved.pop(tensor_id)
        if not offloaded:
            return tensor
        self.host.free(tensor.untyped_storage().nbytes())
        if not self.stash_size:
            return tensor.to("cuda", non_blocking=True)
        node = torch._C._current_autograd_node()
        earlier = []
        if node is not None and node is not self.node:  # a new node: the previous node's copies go after it
            self.node = node
            earlier = list(self.backward_stash)
        if tensor_id in self.forward_stash:
            device_tensor = self.forward_stash[tensor_id]  # never left the device
        else:
            device_tensor = self.backward_stash[tensor_id] = tensor.to("cuda", non_blocking=True)

        def release(outputs, inputs):
            self.forward_stash.clear()  # backward has begun: the forward's stash is not needed
            for old in earlier:
                self.backward_stash.pop(old, None)

        if node is not None:
            node.register_hook(release)
        return device_tensor


def output_heads(model: nn.Module, workload) -> list[nn.Module]:
    """The modules whose saved tensors stay on the device: the workload's output head (a causal LM's `lm_head`)."""
    head = workload.output_head(model) if workload is not None else None
    return [head] if isinstance(head, nn.Module) else []


@register_strategy
class OffloadActivations(Strategy):
    """torchtune's activation offloading (see the module docstring).

    Options, torchtune's names and defaults: `min_offload_size` (1024 bytes: smaller saved tensors stay),
    `use_streams` (true: the stashes of the second stream's copies), `max_fwd_stash_size` (5).

    Limitations: CUDA only. Saved tensors under `min_offload_size` bytes, parameters and the output head's saved
    tensors stay on the device, and with `use_streams` the stashes keep offloaded tensors on the device longer than
    their copy needs (the module docstring). The host copies are not in `peak_mem_bytes` (device memory): they are
    `offload_host_peak_bytes`. Composed with `checkpoint`, only what autograd saves outside the checkpoints moves."""

    name = "offload_activations"
    keeps_training_state = True
    row_columns = ("offload_host_peak_bytes",)
    description = ("torchtune's activation offloading: saved activations (not parameters, >= 1 KiB) in pinned host "
                   "memory, the output head's kept, CUDA only")
    options = {"min_offload_size": 1024, "use_streams": True, "max_fwd_stash_size": 5}
    phases = ("train",)
    devices = ("cuda",)
    priority = 35  # as offload: inside checkpoint's patching, outside autocast
    conflicts = ("offload",)
    # CUDA only; its device bytes are pinned on fake CUDA (tests_cuda_fake/test_activation_offload.py)
    memory_effect = {}  # no band on captcha_resnet18: see above

    def __init__(self, **options):
        super().__init__(**options)
        for option in ("min_offload_size", "max_fwd_stash_size"):
            value = self.settings[option]
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if "stash" in option else 0):
                raise UsageError(f"offload_activations:{option}={value} must be a whole number"
                                 f"{' of at least 1' if 'stash' in option else ' of bytes, 0 or more'}")
        self.host = HostBytes()
        self._heads: list[nn.Module] = []

    def check(self, context):
        if context.device not in self.devices:
            raise Unsupported(f"offload_activations needs device cuda, not {context.device}: on the CPU the host is "
                              "the device, so the copies save nothing")
        super().check(context)

    def prepare_model(self, model, units):
        self._heads = output_heads(model, self.context.workload)
        return model

    @contextlib.contextmanager
    def forward(self):
        self.host = HostBytes()  # one step's copies: the last forward's figure is the row's
        hooks = OffloadedActivations(self.host, self.settings["min_offload_size"],
                                     self.settings["max_fwd_stash_size"], self.settings["use_streams"])
        kept = []
        for head in self._heads:  # torchtune's NoOpManager around the output head
            noop = saved_tensors_hooks(lambda t: t, lambda t: t)
            kept.append(head.register_forward_pre_hook(lambda *args, noop=noop: noop.__enter__()))
            kept.append(head.register_forward_hook(lambda *args, noop=noop: noop.__exit__(None, None, None),
                                                   always_call=True))
        try:
            with hooks:
                yield
        finally:
            for handle in kept:
                handle.remove()

    def columns(self):
        return {"offload_host_peak_bytes": self.host.peak_bytes}
