"""BatchNorm -> activation strategies (the memory-saving article): bn_act_recompute is the baseline's result exactly,
inplace_abn's backward is the derivative of BN + leaky ReLU, both lower the train peak, models without pairs are
`unsupported` with the reason. Tiny cases; figures quoted were measured here (torch 2.13 CPU, exact tracker)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from bench.run.runner import run_case
from strategies import parse_strategy
from strategies.framework.bn_act_pairs import find_pairs
from strategies.inplace_abn import InPlaceABNFunction, inplace_abn
from workloads import get_workload
from small_cases import measured as _memory, small_case as _case, verified as _verify

UNET = "unet:depth=2:base_channels=4:image_size=32x16"
GPT = "gpt_mini:layers=2:width=32:heads=2:seq_len=16"


@functools.lru_cache(maxsize=None)
def _peak(workload: str, strategy: str) -> int:
    return _memory(workload, strategy)["peak_mem_bytes"]


# --- finding the pairs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("workload,expected", [
    # the stem and each block's first BN feed F.relu; each block's second BN feeds the residual add
    ("captcha_resnet18", (9, 20, {"relu"})),
    ("unet:depth=2:base_channels=4:image_size=32x16", (10, 10, {"ReLU"})),  # every double conv: (BN, ReLU) x 2
])
def test_pairs_found_by_tracing(workload, expected):
    pairs, batchnorms = find_pairs(get_workload(workload).build_model(), workload)
    names = {type(p.act_module).__name__ if p.act_module is not None else p.act_function.__name__ for p in pairs}
    assert (len(pairs), batchnorms, names) == expected
    if workload == "captcha_resnet18":
        assert "layer1.0.conv2.1" not in {p.bn_name for p in pairs}  # BN -> add -> ReLU is no pair
        assert all(p.input_exclusive for p in pairs)  # each BN reads a conv output nothing else reads


# --- bn_act_recompute: the baseline's result, exactly ------------------------------------------------------

@pytest.mark.parametrize("workload", ["captcha_resnet18", UNET])
def test_bn_act_recompute_matches_the_baseline(workload):
    result = _verify(workload, "bn_act_recompute")
    assert result["matches_baseline"] is True and result["bn_stats_match"] is True, result
    # the same arithmetic on the same input: not merely within tolerance
    assert result["loss_rel_diff"] == 0 and result["max_grad_rel_diff"] == 0, result
    assert "message" not in result


def test_bn_act_recompute_lowers_the_train_peak():
    # unet (small) at batch 2: baseline 430,044 B, bn_act_recompute 351,552 B (0.817)
    assert _peak(UNET, "bn_act_recompute") < 0.9 * _peak(UNET, "baseline")


# --- inplace_abn -------------------------------------------------------------------------------------------

def _reference(x, weight, bias, slope=0.01, eps=1e-5):
    """Out-of-place BatchNorm (training) and leaky ReLU through autograd: what InPlace-ABN must differentiate."""
    return nn.functional.leaky_relu(nn.functional.batch_norm(x, None, None, weight, bias, True, 0.1, eps), slope)


def test_inplace_abn_backward_passes_gradcheck_and_equals_autograd():
    torch.manual_seed(0)
    x = torch.randn(3, 4, 5, 2, dtype=torch.float64, requires_grad=True)
    weight = (torch.rand(4, dtype=torch.float64) + 0.5).requires_grad_()
    weight.data[1] *= -1  # a negative gamma is inverted as well
    bias = torch.randn(4, dtype=torch.float64, requires_grad=True)

    def fused(x, weight, bias):
        return InPlaceABNFunction.apply(x.clone(), weight, bias, None, None, 0.1, 1e-5, 0.01)

    assert torch.autograd.gradcheck(fused, (x, weight, bias))
    grad_out = torch.randn_like(x)
    got = torch.autograd.grad(fused(x, weight, bias), (x, weight, bias), grad_out)
    expected = torch.autograd.grad(_reference(x, weight, bias), (x, weight, bias), grad_out)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_inplace_abn_overwrites_its_input_and_updates_statistics_as_batchnorm():
    torch.manual_seed(0)
    ours, theirs = nn.BatchNorm2d(4), nn.BatchNorm2d(4, momentum=None)
    theirs.momentum = ours.momentum
    x = torch.randn(2, 4, 3, 3)
    overwritten = x.clone()
    out = inplace_abn(overwritten, ours, 0.01)
    assert out.data_ptr() == overwritten.data_ptr()
    torch.testing.assert_close(out, nn.functional.leaky_relu(theirs(x), 0.01))
    for mine, reference in zip(ours.buffers(), theirs.buffers()):
        torch.testing.assert_close(mine, reference)


def test_inplace_abn_equals_the_model_with_its_pair_relus_made_leaky():
    # On unet every ReLU is a pair's: InPlace-ABN is then the baseline model with leaky ReLUs, up to rounding.
    workload = get_workload(UNET)
    model = workload.build_model()
    reference = copy.deepcopy(model)
    for pair in find_pairs(reference, UNET)[0]:
        parent, _, child = pair.act_name.rpartition(".")
        setattr(reference.get_submodule(parent), child, nn.LeakyReLU(0.01))
    strategy = parse_strategy("inplace_abn")
    model = strategy.prepare_model(model, [])
    x, y = workload.make_batch(4, "synthetic")
    with strategy.forward():
        workload.loss(model(x), y).backward()
    workload.loss(reference(x), y).backward()
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert float((ours.grad - theirs.grad).norm() / theirs.grad.norm()) < 1e-4
    for ours, theirs in zip(model.buffers(), reference.buffers()):
        torch.testing.assert_close(ours, theirs)


def test_inplace_abn_differs_by_design_and_says_by_how_much():
    result = _verify("captcha_resnet18", "inplace_abn")
    assert "does not match the baseline by design" in result["message"], result
    assert "leaky ReLU of slope 0.01" in result["message"] and "9 BatchNorm pairs" in result["message"]
    assert 0 < result["loss_rel_diff"] < 0.01, result  # the measured difference is in the row


def test_inplace_abn_lowers_the_train_peak():
    # unet (small) at batch 2: baseline 430,044 B, inplace_abn 360,140 B (0.837)
    assert _peak(UNET, "inplace_abn") < 0.9 * _peak(UNET, "baseline")


# --- models without pairs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["bn_act_recompute", "inplace_abn"])
@pytest.mark.parametrize("workload", [GPT, "deep_mlp:layers=4:width=8"])
def test_no_batchnorm_is_unsupported_with_the_reason(workload, strategy):
    row = run_case(_case(workload, strategy), env={})
    assert row["status"] == "unsupported", row
    assert "has no BatchNorm layer" in row["message"] and strategy in row["message"], row["message"]


@pytest.mark.parametrize("strategy", ["bn_act_recompute", "inplace_abn"])
def test_eval_is_unsupported(strategy):
    row = run_case(_case(UNET, strategy, phase="eval"), env={})
    assert row["status"] == "unsupported" and "eval" in row["message"], row
