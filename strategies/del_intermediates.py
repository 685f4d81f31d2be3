"""Frees every reference the loop no longer needs at the end of each step: its output and loss, and the gradients."""

from strategies import Strategy, register_strategy


@register_strategy
class DelIntermediates(Strategy):
    """Drops what the article's loop keeps alive between steps, and zeroes gradients with `set_to_none=True`.

    The article's loop (`pred = model(x); loss = criterion(pred, y)`) keeps the previous step's `pred` until the
    next forward returns and rebinds it, and its `loss` until the next loss exists; `del pred, loss` at the end of
    the step frees them before the next forward. In training that costs little: after `backward()` the graph is
    freed, so they hold only the output and the loss, alive during the next forward but no longer at a backward
    peak. In eval with autograd on (the article's validation), `pred` holds the previous batch's whole autograd
    graph with every saved activation, alive while the next batch's forward builds its own: the peak, at the end of
    that forward, holds two graphs. Exact.

    Limitations: it frees only what the loop itself keeps between steps (the previous output and loss, and
    the gradients): in training the backward has freed the graph by then, so where the peak falls in backward the
    train peak is the baseline's (1.000 on captcha_resnet18).
    """

    name = "del_intermediates"
    keeps_training_state = True
    description = "output/loss released at the end of each step, not in the next forward; zero_grad(set_to_none=True)"
    priority = 60
    # Train 221,411,228 -> 221,411,228 (1.000) on captcha_resnet18: the loop itself releases the previous output and
    # loss before the backward peak (`pred =`, `loss =`); the Session once kept them, and the baseline was
    # 221,420,444. Eval 143,910,368 -> 94,688,224 (0.658): the kept output of the previous batch holds its whole
    # autograd graph.
    memory_effect = {"train": (0.99, 1.0), "eval": (0.6, 0.7)}

    def zero_grad(self, optimizer):
        optimizer.zero_grad(set_to_none=True)

    def end_step(self, kept):
        kept.clear()
