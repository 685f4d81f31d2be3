"""The optimizer step inside backward: each parameter is updated, and its gradient freed, as soon as it is ready."""

from __future__ import annotations

import weakref

import torch

from strategies import Strategy, register_strategy


class StepsInBackward:
    """One optimizer per parameter, each stepped by that parameter's post-accumulate-grad hook.

    Stands where the training loop expects its optimizer: `state` and `param_groups` are those of the
    per-parameter optimizers (the memory breakdown files their state as optimizer state); `step()` and
    `zero_grad()` have nothing left to do.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        cls = type(optimizer)
        self.optimizers = {param: cls([{**group, "params": [param]}])
                           for group in optimizer.param_groups for param in group["params"]}
        # The hooks reach this object through a weak reference: a strong one would make a cycle (parameter ->
        # hook -> optimizer -> parameter) that only the cyclic collector frees, keeping every pass's state alive.
        owner = weakref.ref(self)

        def step_parameter(param: torch.Tensor) -> None:
            steps = owner()
            if steps is not None:
                steps.step_parameter(param)

        self.handles = [param.register_post_accumulate_grad_hook(step_parameter)
                        for param in self.optimizers if param.requires_grad]

    def step_parameter(self, param: torch.Tensor) -> None:
        optimizer = self.optimizers[param]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # the point: no moment holds every gradient

    @property
    def state(self) -> dict:
        return {param: optimizer.state[param] for param, optimizer in self.optimizers.items()}

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self.optimizers.values() for group in optimizer.param_groups]

    def step(self) -> None:
        """Nothing: every parameter stepped during backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: every gradient was freed by its step."""


@register_strategy
class OptimizerInBackward(Strategy):
    """`Tensor.register_post_accumulate_grad_hook` runs each parameter's optimizer step the moment backward has
    accumulated its gradient, then frees the gradient (PyTorch's "optimizer step in backward" recipe). Where the
    baseline's peak holds every gradient at once (at the end of backward, or during the step), this one holds only
    those not yet applied: the gradient part of the peak shrinks, by up to the size of the weights. Where the peak
    is in the forward (a large batch's activations) it saves nothing.

    The same update per parameter: must match the baseline (the weights after one step are compared). Training
    only.

    Limitations: it cannot accumulate gradients (each backward steps at once), clip them by their global norm, or
    unscale them all together (GradScaler), so it refuses grad_accumulation, amp and keep_grads; its per-parameter
    steps cannot use a multi-tensor (foreach/fused) path over all parameters.
    """

    name = "optimizer_in_backward"
    keeps_training_state = True
    description = "each parameter's optimizer step runs in backward as soon as its gradient is ready, then frees it"
    phases = ("train",)
    priority = 60
    conflicts = ("grad_accumulation", "amp", "keep_grads")
    # Train 221,420,444 -> 212,650,332 (0.960) on captcha_resnet18: the peak is in backward; at most one gradient is
    # alive there (tests/test_strategies.py: test_optimizer_in_backward_frees_the_gradients_at_the_peak).
    memory_effect = {"train": (0.95, 0.97)}

    def wrap_optimizer(self, optimizer, model):
        return StepsInBackward(optimizer)
