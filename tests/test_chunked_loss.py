"""chunked_loss: the head and the cross-entropy by chunks of tokens match the baseline and lower the train peak.

Tiny models on the CPU (synthetic data, batch 2); memory from the exact live-tensor tracker (`memory_pass`).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bench.core.errors import UsageError
from bench.run.case import Case, bind_case
from bench.run.runner import run_case
from bench.run.session import Session
from strategies import parse_strategy
from small_cases import measured as _memory, small_case as _case, verified as _verify

GPT = "gpt_mini:layers=2:width=32:heads=2:seq_len=16"
# one layer and a 64-token sequence: the 256-byte vocabulary's logits dominate a width-32 model's step
GPT_LOGITS = "gpt_mini:layers=1:width=32:heads=2:seq_len=64"
TINY_GPT2 = "hf:tiny-gpt2:seq_len=16"
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed")


def _peak(workload: str, spec: str) -> int:
    return _memory(workload, spec)["peak_mem_bytes"]


@pytest.mark.parametrize("workload", [GPT, pytest.param(TINY_GPT2, marks=needs_transformers)])
@pytest.mark.parametrize("chunks", [1, 3, 8, 100])  # 3 does not divide 32 tokens; 100 is more chunks than tokens
def test_loss_and_gradients_match_the_baseline(workload, chunks):
    result = _verify(workload, f"chunked_loss:chunks={chunks}")
    assert result["matches_baseline"] is True, result
    assert result["params_without_grad"] == 0
    assert result["loss_rel_diff"] <= 1e-6 and result["max_grad_rel_diff"] <= 1e-6, result
    if chunks == 1:  # one chunk is the baseline's arithmetic in the baseline's order
        assert result["loss_rel_diff"] == 0 and result["max_grad_rel_diff"] == 0, result


@pytest.mark.parametrize("spec", ["chunked_loss+checkpoint", "chunked_loss:chunks=4+checkpoint:segments=1"])
def test_composes_with_checkpoint(spec):
    assert _verify(GPT, spec)["matches_baseline"] is True


def _most_logit_rows(spec: str) -> int:
    """The most rows of any tensor of one training step whose last dimension is the 256-byte vocabulary."""
    case = Case("gpt_mini:layers=1:width=16:heads=2:seq_len=32", spec, "train", 2, "cpu", data="synthetic",
                warmup=0, steps=1)
    strategy, context = bind_case(case)
    strategy.check(context)
    session = Session(case, strategy)
    most = [0]

    class MostRows(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == 256:
                    most[0] = max(most[0], t.numel() // 256)
            return out

    with MostRows():
        session.train_step()
    return most[0]


def test_the_whole_logits_never_exist():
    """The baseline's logits have a row per token (2 x 32); chunked, at most a chunk's 16 rows exist at once (the
    head's transposed weight has 16 rows as well, the width)."""
    assert _most_logit_rows("baseline") == 64
    assert _most_logit_rows("chunked_loss:chunks=4") == 16


@pytest.mark.parametrize("workload", [GPT_LOGITS, pytest.param("hf:tiny-gpt2:seq_len=64", marks=needs_transformers)])
def test_train_peak_is_lower_where_the_logits_dominate(workload):
    # gpt_mini 1,477,836 -> 953,548 (0.645); hf:tiny-gpt2 (vocabulary 512) 3,295,356 -> 2,214,012 (0.672)
    ratio = _peak(workload, "chunked_loss") / _peak(workload, "baseline")
    assert 0.55 <= ratio <= 0.75, ratio


def test_unsupported_without_a_separable_head():
    for phase in ("train", "eval"):
        row = run_case(_case("captcha_resnet18", "chunked_loss", phase), env={})
        assert row["status"] == "unsupported", row
        assert "captcha_resnet18" in row["message"] and "has no separable output head" in row["message"], row


def test_eval_is_unsupported_on_a_language_model():
    row = run_case(_case(GPT, "chunked_loss", "eval"), env={})
    assert row["status"] == "unsupported" and "applies to phase train only" in row["message"], row


@needs_transformers
def test_a_masked_lm_declares_no_head():
    row = run_case(_case("hf:tiny-bert:seq_len=16", "chunked_loss"), env={})
    assert row["status"] == "unsupported" and "has no separable output head" in row["message"], row


def test_chunks_below_one_is_a_usage_error():
    with pytest.raises(UsageError, match="chunks=0 must be at least 1"):
        parse_strategy("chunked_loss:chunks=0")
