"""`zero_grad(set_to_none=False)`: the old default, which keeps every gradient buffer alive between steps."""

from strategies import Strategy, register_strategy


@register_strategy
class KeepGrads(Strategy):
    """Gradients zeroed in place instead of freed (PyTorch's default before 2.0). The next backward accumulates into
    the zeroed buffers, so the result is the baseline's exactly; the cost is memory wherever the baseline holds no
    gradient: through the forward, a buffer the size of the weights stays allocated. Where the peak is at the end
    of backward or in the step, every gradient exists in both, and it costs nothing. Training only.

    Limitations: it never saves memory, so the planner never tries it (`plan_excluded`); its cost shows only where
    the baseline's peak holds no gradient (above), so it declares no band on captcha_resnet18 (pinned on deep_mlp).
    """

    name = "keep_grads"
    description = "zero_grad(set_to_none=False): gradient buffers zeroed, kept alive between steps"
    phases = ("train",)
    plan_excluded = "keeps the gradient buffers alive between steps: more memory than the baseline, never less"
    # Train 221,420,444 -> 239,090,844 (1.080) on captcha_resnet18: early in backward the zeroed buffers of every
    # gradient are there. Pinned on deep_mlp in tests/test_training_loop.py (a captcha pass at batch 8 costs ~30 s)
    memory_effect = {}  # no band on captcha_resnet18: see above

    def zero_grad(self, optimizer):
        optimizer.zero_grad(set_to_none=False)
