"""The article's rule of thumb for a training step's memory: parameters + every module's output (x2) + optimizer."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from workloads import get_workload, tensors_of, to_device

OPTIMIZER_STATE_FACTOR = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adagrad": 1, "RMSprop": 1}


def optimizer_state_factor(optimizer: torch.optim.Optimizer) -> int:
    """Copies of the parameters the optimizer keeps: Adam 2 (3 with amsgrad), SGD with momentum 1, plain SGD 0."""
    name = type(optimizer).__name__
    defaults = optimizer.defaults
    if name == "SGD":
        return 1 if defaults.get("momentum", 0) else 0
    if name == "RMSprop":
        return 1 + bool(defaults.get("momentum", 0)) + bool(defaults.get("centered", False))
    return OPTIMIZER_STATE_FACTOR.get(name, 0) + bool(defaults.get("amsgrad", False))


@functools.lru_cache(maxsize=64)
def rule_of_thumb(workload: str, phase: str, batch_size: int) -> dict[str, Any]:
    """The article's estimate for `workload` (a spec): parameters + sum of every module's output (x2 with backward) + optimizer state.

    Module outputs are recorded with forward hooks on every module of `model.modules()` except the root,
    containers (nn.Sequential, the BasicBlocks) included, as the article's loop iterates them; the article's
    code instead feeds each module the previous module's output, which only works for a purely sequential model,
    so hooks on one real forward are used here. An in-place nn.ReLU module is skipped (the article's rule).
    The forward runs on the meta device (shapes only) and counts 4 bytes an element (the article's
    `type_size=4`): the estimate depends on the model, batch and phase only, not on the strategy.
    """
    wl = get_workload(workload)
    model = wl.build_model().to("meta")
    model.train(phase == "train")
    data = "synthetic" if "synthetic" in wl.data_sources else wl.data_sources[0]
    inputs = to_device(wl.make_batch(batch_size, data)[0], "meta")
    outputs: list[int] = []

    def hook(module, inputs, output):
        if isinstance(module, nn.ReLU) and module.inplace:
            return
        outputs.append(sum(t.numel() for t in tensors_of(output)))

    modules = list(model.modules())[1:]
    handles = [m.register_forward_hook(hook) for m in modules]
    with torch.no_grad():
        wl.run_model(model, inputs)
    for h in handles:
        h.remove()
    type_size = 4
    params = sum(p.numel() for p in model.parameters()) * type_size
    out_bytes = sum(outputs) * type_size
    train = phase == "train"
    factor = optimizer_state_factor(wl.make_optimizer(wl.build_model())) if train else 0
    optimizer = factor * params
    total = params + out_bytes * (2 if train else 1) + optimizer
    return {"params_bytes": params, "outputs_bytes": out_bytes, "modules_counted": len(outputs),
            "outputs_factor": 2 if train else 1, "optimizer_bytes": optimizer, "total_bytes": total}


RULE_OF_THUMB_CAVEATS = [
    "it sums every module's output, containers included, so a block's output is counted again by its Sequential",
    "x2 for backward assumes every output is saved once more; autograd saves only what each op needs "
    "(a conv keeps its input, BatchNorm its input and stats) and frees saved tensors during backward",
    "it knows nothing of in-place ops (functional relu), views, or temporaries inside a module",
    "it ignores the gradients (1x params), the batch, and the output and loss the loop keeps between steps",
    "it is the same for every strategy (checkpointing, amp, no_grad eval change nothing in it)",
]
