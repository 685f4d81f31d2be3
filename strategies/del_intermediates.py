"""Frees every reference the loop no longer needs: the previous step's output and loss, and the gradients."""

from strategies.base import Strategy, register_strategy


@register_strategy
class DelIntermediates(Strategy):
    """Drops what the article's loop keeps alive between steps, and zeroes gradients with `set_to_none=True`.

    The article's loop keeps `predicted` and `loss` until the next step overwrites them. In training that costs
    little: after `backward()` the graph is freed, so they hold only the output and a scalar. In eval with autograd
    on (the article's validation), `predicted` holds the previous batch's whole autograd graph with every saved
    activation, alive while the next batch's forward builds its own: the peak holds two graphs. Exact.
    """

    name = "del_intermediates"
    description = "previous step's output/loss released at the end of each step; zero_grad(set_to_none=True)"
    priority = 60

    @classmethod
    def plan_options(cls, space):
        """One setting, the defaults: nothing to search."""
        return [{}]

    def zero_grad(self, optimizer):
        optimizer.zero_grad(set_to_none=True)

    def end_step(self, kept):
        kept.clear()
