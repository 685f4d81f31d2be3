"""In-place ReLU: every ReLU-like activation of the model overwrites its input instead of allocating an output."""

from torch import nn

from bench.core.errors import Unsupported
from strategies import MATCHES, Strategy, register_strategy, unsupported

# activation modules with an `inplace` switch (nn.Dropout has one too, but it is no activation)
RELU_LIKE = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.CELU, nn.SELU, nn.RReLU, nn.Hardtanh, nn.Threshold,
             nn.SiLU, nn.Hardswish, nn.Hardsigmoid, nn.Mish)


def make_relus_inplace(model: nn.Module) -> tuple[int, int]:
    """Switches every ReLU-like activation of `model` to in place: its `inplace` attribute, or the `inplace_relu`
    flag of modules that call the functional form (the captcha ResNet). Returns (found, switched)."""
    found = switched = 0
    for module in model.modules():
        if hasattr(module, "inplace_relu"):
            found += 1
            switched += not module.inplace_relu
            module.inplace_relu = True
        if isinstance(module, RELU_LIKE):
            found += 1
            switched += not module.inplace
            module.inplace = True
    return found, switched


@register_strategy
class InplaceReLU(Strategy):
    """Every ReLU computed in place. Exact: the same arithmetic, written over the pre-activation.

    What it saves is small here, by construction of conv -> BN -> ReLU: ReLU saves its *output* for backward and
    BatchNorm's backward needs its input (the conv output), not its own output, so the BN output is needed only
    until ReLU has run. In-place ReLU therefore removes a transient buffer, not a saved activation; in training
    the peak barely moves (see tests/test_strategies.py for the measured ratio).

    A model without a ReLU-like activation module (GELU transformers, a purely linear MLP), or whose activations
    are all in place already (most timm CNNs), is an `unsupported` row that says so.

    Limitations: it sees only activation modules with an `inplace` switch and modules with an `inplace_relu`
    flag: a functional `F.relu` in a model's forward without such a flag is left as it is. Where the tensor it
    overwrites is saved for backward by the operation that made it (a ReLU after a sigmoid), autograd's version check
    raises in backward and the row is an `error`. In training it removes a transient, not a saved activation, so the
    train peak barely moves (above).
    """

    name = "inplace_relu"
    keeps_training_state = True
    description = "every ReLU-like activation computed in place (inplace=True), no separate output buffer"
    priority = 20  # transforms the plain model before checkpoint wraps it
    # Train 221,420,444 -> 221,420,444 (1.000) on captcha_resnet18: conv -> BN -> ReLU, ReLU saves its output for
    # backward and BN's backward needs its input, not its output, so in-place ReLU only removes a transient that is
    # not at the peak (in backward). Eval 143,910,368 -> 143,591,904 (0.998).
    memory_effect = {"train": (0.99, 1.0), "eval": (0.99, 1.0)}
    expected = unsupported("no ReLU-like activation")  # SiLU (llama), GELU (gpt_mini, gpt2, bert), deep_mlp's Tanh
    expected_with = {"relu_like": MATCHES, "relu_like_in_place": unsupported("in place already")}
    refusals = (r"has no ReLU-like activation module", r"every ReLU-like activation of .* is in place already")

    def prepare_model(self, model, units):
        found, switched = make_relus_inplace(model)
        owner = self.model_owner()
        if not found:
            raise Unsupported(f"inplace_relu: {owner} has no ReLU-like activation module to switch")
        if not switched:
            raise Unsupported(f"inplace_relu: every ReLU-like activation of {owner} is in place already")
        return model
