"""`zero_grad(set_to_none=False)`: the old default, which keeps every gradient buffer alive between steps."""

from strategies.base import Strategy, register_strategy


@register_strategy
class KeepGrads(Strategy):
    """Gradients zeroed in place instead of freed (PyTorch's default before 2.0). The next backward accumulates into
    the zeroed buffers, so the result is the baseline's exactly; the cost is memory wherever the baseline holds no
    gradient: through the forward, a buffer the size of the weights stays allocated. Where the peak is at the end
    of backward or in the step, every gradient exists in both, and it costs nothing. Training only.
    """

    name = "keep_grads"
    description = "zero_grad(set_to_none=False): gradient buffers zeroed, kept alive between steps"
    phases = ("train",)
    plan_excluded = "keeps the gradient buffers alive between steps: more memory than the baseline, never less"

    def zero_grad(self, optimizer):
        optimizer.zero_grad(set_to_none=False)
