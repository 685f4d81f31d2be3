"""The names a user can give a strategy that targets modules by name (`lora:targets=a/b`), read from the workload's
model built on the meta device (no memory), for the message that asks for them."""

from __future__ import annotations

import torch
from torch import nn

SHOWN = 12  # names listed at most; the count of the rest follows


def linear_module_suffixes(workload) -> list[str]:
    """The last part of the name of each of the model's Linear modules (what peft's `target_modules` matches),
    once each, in the model's order; [] where the model cannot be built on meta."""
    try:
        with torch.device("meta"):
            model = workload.build_model()
    except Exception:  # noqa: BLE001 - a model that needs real tensors to build: the message goes without names
        return []
    return list(dict.fromkeys(name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                              if name and isinstance(module, nn.Linear)))


def listed(names: list[str]) -> str:
    """`names` as a message lists them: the first SHOWN, then how many more."""
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more
