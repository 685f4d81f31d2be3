"""The optimizer: another implementation of the workload's (foreach, for_loop, fused), or another algorithm."""

from __future__ import annotations

import inspect

import torch

from bench.core.errors import Unsupported, UsageError
from strategies.base import Strategy, register_strategy

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "adafactor": torch.optim.Adafactor,
}
# impl -> the constructor's (foreach, fused); None lets PyTorch choose (foreach on CUDA, for_loop on the CPU)
IMPLEMENTATIONS: dict[str, tuple[bool | None, bool | None]] = {
    "default": (None, None), "foreach": (True, None), "for_loop": (False, None), "fused": (None, True),
}


def implementation(optimizer: torch.optim.Optimizer) -> str:
    """Which implementation `optimizer.step()` runs: fused, foreach or for_loop (PyTorch's choice resolved)."""
    group = optimizer.param_groups[0]
    if group.get("fused"):
        return "fused"
    if group.get("foreach") is None:
        from torch.optim.optimizer import _default_to_fused_or_foreach

        params = [p for g in optimizer.param_groups for p in g["params"]]
        return "foreach" if _default_to_fused_or_foreach(params, False, False)[1] else "for_loop"
    return "foreach" if group["foreach"] else "for_loop"


@register_strategy
class Optimizer(Strategy):
    """Replaces the workload's optimizer with another implementation or another algorithm.

    `impl`: `for_loop` steps one parameter at a time; `foreach` runs each operation over every parameter at once
    (faster, but its temporaries exist for all parameters together); `fused` is one kernel per group. The same
    arithmetic: the row must match the baseline. `name`: SGD (no state), Adam and AdamW (two moments: twice the
    weights), Adafactor (factored second moments: a row and a column per matrix), each with PyTorch's default
    hyperparameters; an algorithm other than the workload's changes the weights' update, so that row does not
    match the baseline, by design. Training only (eval has no step).
    """

    name = "optimizer"
    description = "the workload's optimizer with another implementation (impl=), or another algorithm (name=)"
    phases = ("train",)
    options = {"name": "workload", "impl": "default"}
    priority = 30  # before optimizer_in_backward, which splits whatever optimizer this makes

    @classmethod
    def plan_options(cls, space):
        """The workload's optimizer in each implementation, and plain SGD, with less state (another update:
        differs_by_design, so out of an answer unless --allow-different). Not Adafactor: fake tensors cannot run
        its step, so each prediction would cost a real one."""
        return [{"impl": "foreach"}, {"impl": "for_loop"}, {"impl": "fused"}, {"name": "sgd"}]

    def __init__(self, **options):
        super().__init__(**options)
        if self.settings["name"] not in ("workload", *OPTIMIZERS):
            raise UsageError(f"optimizer:name={self.settings['name']!r}; valid choices: workload, "
                             f"{', '.join(OPTIMIZERS)}")
        if self.settings["impl"] not in IMPLEMENTATIONS:
            raise UsageError(f"optimizer:impl={self.settings['impl']!r}; valid choices: {', '.join(IMPLEMENTATIONS)}")
        self.replaced: str | None = None  # the workload's optimizer's class name, when name= replaced it
        self.resolved = {"name": self.settings["name"], "impl": self.settings["impl"]}

    def wrap_optimizer(self, optimizer, model):
        name = self.settings["name"]
        cls = type(optimizer) if name == "workload" else OPTIMIZERS[name]
        foreach, fused = IMPLEMENTATIONS[self.settings["impl"]]
        accepted = inspect.signature(cls).parameters
        if fused and "fused" not in accepted:
            raise Unsupported(f"{cls.__name__} has no fused implementation")
        chosen = {key: value for key, value in (("foreach", foreach), ("fused", fused)) if key in accepted}
        groups = [{**({k: v for k, v in group.items() if k != "params"} if cls is type(optimizer) else {}),
                   "params": group["params"], **chosen} for group in optimizer.param_groups]
        replacement = cls(groups)
        self.replaced = type(optimizer).__name__ if cls is not type(optimizer) else None
        self.resolved = {"name": cls.__name__, "impl": implementation(replacement)}
        return replacement

    def describe(self):
        return {f"optimizer.{key}": value for key, value in self.resolved.items()}

    def differs_by_design(self):
        if self.replaced is None:
            return None
        return f"{self.resolved['name']} replaces the workload's {self.replaced}: another update of the weights"
