"""The article's training and validation code as it is."""

from strategies.base import Strategy, register_strategy


@register_strategy
class Baseline(Strategy):
    """No technique: forward, BCELoss, backward, Adam step, zero_grad; eval keeps autograd on."""

    name = "baseline"
    description = "the article's code as it is: fp32, autograd on in eval, outputs kept until the next step"
