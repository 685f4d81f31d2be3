"""The article's training and validation code as it is."""

from bench.core.results import Role
from strategies import Strategy, register_strategy


@register_strategy
class Baseline(Strategy):
    """No technique: forward, BCELoss, backward, Adam step, zero_grad; eval keeps autograd on.

    Every tensor lives as long as in the literal loop `pred = model(x); loss = criterion(pred, y); ...`: the
    previous step's output until the next forward returns, its loss until the next loss exists.
    """

    name = "baseline"
    keeps_training_state = True
    plan_excluded = "the starting point itself: every plan is the baseline plus techniques"
    description = "the article's code as it is: fp32, autograd on in eval, the loop's lifetimes (pred/loss rebound)"
    recompute_plan_kind = "none"  # the plan that recomputes nothing, the first point of the plan chart
    memory_effect = {"train": (1.0, 1.0), "eval": (1.0, 1.0)}

    def role(self):
        return Role.BASELINE.value

    def recompute_plan(self):
        return "none"
