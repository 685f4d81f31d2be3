"""In-place ReLU: every ReLU of the model overwrites its input instead of allocating an output."""

from torch import nn

from strategies.base import Strategy, register_strategy


def make_relus_inplace(model: nn.Module) -> int:
    """Sets `inplace_relu = True` on every module with that flag and `inplace=True` on every nn.ReLU; returns the count."""
    changed = 0
    for module in model.modules():
        if hasattr(module, "inplace_relu"):
            module.inplace_relu = True
            changed += 1
        if isinstance(module, nn.ReLU):
            module.inplace = True
            changed += 1
    return changed


@register_strategy
class InplaceReLU(Strategy):
    """Every ReLU computed in place. Exact: the same arithmetic, written over the pre-activation.

    What it saves is small here, by construction of conv -> BN -> ReLU: ReLU saves its *output* for backward and
    BatchNorm's backward needs its input (the conv output), not its own output, so the BN output is needed only
    until ReLU has run. In-place ReLU therefore removes a transient buffer, not a saved activation; in training
    the peak barely moves (see tests/test_strategies.py for the measured ratio).
    """

    name = "inplace_relu"
    description = "every ReLU computed in place (inplace=True), no separate output buffer"
    priority = 20  # transforms the plain model before checkpoint wraps it

    def prepare_model(self, model, stages):
        make_relus_inplace(model)
        for stage in stages:
            make_relus_inplace(stage)
        return model
