"""Pitfall: `backward(retain_graph=True)` where nothing calls backward on the graph a second time."""

from strategies import Strategy, register_strategy


@register_strategy
class PitfallRetainGraph(Strategy):
    """`loss.backward(retain_graph=True)` without a second backward (the training-pitfalls article): autograd keeps
    every saved activation after backward instead of freeing it, for as long as something references the graph. The
    article's loop keeps `loss` until the next step's loss rebinds it, so the previous step's activations are alive
    through the next forward, until its loss exists: the peak holds two steps' activations where it fell in the
    forward (or at the loss). The same gradients: it matches the baseline. Training only.

    Limitations: what it keeps into the next step depends on the loop's lifetimes, not on it alone: the kept
    activations belong to the graph, freed when the loop drops the step's output and loss; a loop that drops them
    at the end of its step (`del_intermediates`) carries no previous graph into the next forward.
    """

    name = "pitfall_retain_graph"
    pitfall = True
    description = "loss.backward(retain_graph=True) with no second backward: saved activations kept"
    phases = ("train",)
    # Train: the previous step's saved activations live until the next loss exists (tests/test_training_loop.py)
    memory_effect = {}  # no band on captcha_resnet18: see above

    def backward(self, loss):
        loss.backward(retain_graph=True)
