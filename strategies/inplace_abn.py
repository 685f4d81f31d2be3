"""InPlace-ABN: BatchNorm and a leaky ReLU computed in place in one autograd function that inverts both in backward."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from bench.core.errors import Unsupported, UsageError
from strategies import Strategy, Tolerance, differs, register_strategy, unsupported
from strategies.framework.bn_act_pairs import (
    FusedPairs, Pair, find_pairs, pair_summary, require_batchnorm, require_pairs,
)

DEFAULT_SLOPE = 0.01
TINY_WEIGHT = 1e-12  # |gamma| below this is taken as this (sign kept) when the affine transform is inverted


def _channel_shape(x: torch.Tensor) -> tuple[int, ...]:
    return (1, x.shape[1]) + (1,) * (x.dim() - 2)


class InPlaceABNFunction(torch.autograd.Function):
    """z = leaky_relu(gamma * (x - mean) / sqrt(var + eps) + beta), written over `x`; saves only z (and per-channel
    vectors). Backward recovers y = leaky_relu^-1(z) and x_hat = (y - beta) / gamma from z (Rota Bulò et al.,
    CVPR 2018, eq. 8-11), so BatchNorm's input is not kept.

    `x` must be a tensor nothing else reads afterwards (it is overwritten); `slope` > 0 (the inverse needs it).
    Running statistics are updated as BatchNorm's training forward does, with `factor` as its momentum.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, factor: float, eps: float, slope: float):
        dims = [0, *range(2, x.dim())]
        count = x.numel() // x.shape[1]
        var, mean = torch.var_mean(x, dims, correction=0)
        if running_mean is not None:
            running_mean.mul_(1 - factor).add_(mean, alpha=factor)
            running_var.mul_(1 - factor).add_(var * (count / max(count - 1, 1)), alpha=factor)
        invstd = torch.rsqrt(var + eps)
        scale = weight * invstd
        shift = bias - mean * scale
        shape = _channel_shape(x)
        x.mul_(scale.view(shape)).add_(shift.view(shape))
        torch.nn.functional.leaky_relu_(x, slope)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, weight, bias, invstd)
        ctx.slope, ctx.count = slope, count
        return x

    @staticmethod
    def backward(ctx, grad_z):
        z, weight, bias, invstd = ctx.saved_tensors
        slope, count = ctx.slope, ctx.count
        shape, dims = _channel_shape(z), [0, *range(2, z.dim())]
        negative = z < 0
        grad_y = torch.where(negative, grad_z * slope, grad_z)
        safe_weight = torch.where(weight.abs() < TINY_WEIGHT, torch.full_like(weight, TINY_WEIGHT).copysign(weight),
                                  weight)
        x_hat = torch.where(negative, z / slope, z).sub_(bias.view(shape)).div_(safe_weight.view(shape))
        grad_bias = grad_y.sum(dims)
        grad_weight = (grad_y * x_hat).sum(dims)
        grad_x = None
        if ctx.needs_input_grad[0]:
            # dx = gamma * invstd * (dy - mean(dy) - x_hat * mean(dy * x_hat)), in place over the buffers above
            grad_x = grad_y.sub_(grad_bias.view(shape) / count).sub_(x_hat.mul_(grad_weight.view(shape) / count))
            grad_x.mul_((weight * invstd).view(shape))
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


def inplace_abn(x: torch.Tensor, bn: nn.modules.batchnorm._BatchNorm, slope: float) -> torch.Tensor:
    """`bn` then a leaky ReLU of `slope` on `x`, in training mode, in place over `x`; updates `bn`'s statistics and
    its `num_batches_tracked` exactly as `bn`'s own forward does."""
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    return InPlaceABNFunction.apply(x, bn.weight, bn.bias, bn.running_mean, bn.running_var, factor, bn.eps, slope)


class InPlacePairs(FusedPairs):
    """Each pair runs as one InPlaceABNFunction: over the convolution's output where nothing else reads it (found
    by tracing), else over a copy of BatchNorm's input."""

    def __init__(self, pairs: list[Pair], slopes: list[float]):
        self.slopes = dict(zip([id(p) for p in pairs], slopes))
        super().__init__(pairs, self._forward)

    def _forward(self, pair: Pair, bn_forward, activation, x):
        slope = self.slopes[id(pair)]
        if not pair.bn.training:
            return torch.nn.functional.leaky_relu(bn_forward(x), slope)
        if not (pair.input_exclusive and x.grad_fn is not None and x._base is None):
            x = x.clone()  # the input may be read elsewhere, or is a leaf, or a view: never overwrite it
        return inplace_abn(x, pair.bn, slope)


@register_strategy
class InPlaceABN(Strategy):
    """InPlace-ABN (Rota Bulò, Porzi, Kontschieder, CVPR 2018; mapillary/inplace_abn; the memory-saving article): each
    BatchNorm -> leaky ReLU pair is one autograd function computed in place over BatchNorm's input, which stores
    only its output and recovers what backward needs by inverting the leaky ReLU and the affine transform.

    In the baseline a conv -> BN -> ReLU pair keeps BatchNorm's input and ReLU's output for backward; here only
    the output (one buffer per pair; the next convolution keeps it anyway). InPlace-ABN needs an invertible
    activation: a ReLU is replaced by a leaky ReLU of slope `slope` (default 0.01), so on a ReLU model the result
    differs by design (`differs_by_design()`; the row's `loss_rel_diff` and `max_grad_rel_diff` give by how much).
    A leaky ReLU already there keeps its slope (then the result must match the baseline, to the tolerance of
    inverting in float arithmetic). Other activations (GELU, SiLU) are not invertible this way: their pairs stay.

    Options: `slope` (0.01): the leaky ReLU's negative slope replacing a ReLU (> 0).

    The input is overwritten only where tracing shows a fresh convolution or linear output that only BatchNorm
    reads; elsewhere the pair works on a copy (correct, but not in place). Train only.

    Limitations: the inversion divides by BatchNorm's weight gamma (|gamma| < 1e-12 is taken as 1e-12); mapillary
    trains with |gamma| + eps for that reason, this strategy keeps the model's gamma. Pairs found by torch.fx
    (`strategies.framework.bn_act_pairs`): a model it cannot trace, or without a BatchNorm feeding a ReLU or leaky
    ReLU, is an `unsupported` row with the reason.
    """

    name = "inplace_abn"
    description = "BatchNorm + leaky ReLU in place in one autograd function inverting both in backward (InPlace-ABN)"
    options = {"slope": DEFAULT_SLOPE}
    phases = ("train",)
    priority = 25  # after in-place ReLU changed the model, before checkpoint wraps its units
    conflicts = ("compile", "bn_act_recompute")

    tolerance = Tolerance(loss_rtol=1e-5, grad_rtol=1e-3, step_rtol=1e-3)  # inverting rounds differently
    # Train 221,420,444 -> 211,344,028 (0.954) on captcha_resnet18; ReLU swapped for leaky ReLU: differs by design
    # (tests/test_bn_act.py).
    memory_effect = {"train": (0.93, 0.97)}
    expected = unsupported("has no BatchNorm layer")
    # where a BatchNorm feeds a ReLU, as in every BatchNorm model here (a leaky ReLU there keeps its slope: matches)
    expected_with = {"batch_norm": differs("is a leaky ReLU of slope")}
    refusals = (r"has no BatchNorm layer, so no BatchNorm->activation pair",)

    def __init__(self, **options):
        super().__init__(**options)
        if not float(self.settings["slope"]) > 0:
            raise UsageError(f"inplace_abn:slope={self.settings['slope']} must be > 0 (the inverse divides by it)")
        self.fused: InPlacePairs | None = None
        self.summary: str | None = None
        self.swapped = 0

    def check(self, context):
        require_batchnorm(self.name, context.workload)
        super().check(context)

    def prepare_model(self, model, units):
        found, batchnorms = find_pairs(model, f"{self.name}: {self.model_owner()}")
        pairs = [p for p in found if p.negative_slope() is not None and p.negative_slope() >= 0
                 and p.bn.affine and p.bn.track_running_stats]
        if found and not pairs:
            raise Unsupported(f"{self.name}: the {len(found)} BatchNorm->activation pairs of {self.model_owner()} use "
                              "activations InPlace-ABN cannot invert (only ReLU, swapped for a leaky ReLU, or a "
                              "leaky ReLU)")
        require_pairs(pairs, batchnorms, self.model_owner(), self.name)
        slope = float(self.settings["slope"])
        slopes = [p.negative_slope() or slope for p in pairs]
        self.swapped = sum(p.negative_slope() == 0 for p in pairs)
        self.summary = pair_summary(pairs, batchnorms)
        self.fused = InPlacePairs(pairs, slopes)
        return model

    def forward(self):
        if self.fused is None:
            raise Unsupported(f"{self.name}: forward before prepare_model")
        mode = self.fused.skipping()
        return mode if mode is not None else contextlib.nullcontext()

    def differs_by_design(self):
        if not self.swapped:
            return None
        return (f"InPlace-ABN inverts the activation in backward, so the ReLU of {self.swapped} BatchNorm pairs "
                f"is a leaky ReLU of slope {self.settings['slope']}")

    def describe(self):
        described = super().describe()
        if self.summary:
            described[f"{self.name}.pairs"] = self.summary
        return described
