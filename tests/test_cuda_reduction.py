"""The scratch of CUDA's reduction kernel in a prediction (bench.measure.cuda_reduction): the sizes Reduce.cuh's
launch configuration gives, against those an H200 allocated (results/reference/gpu/h200-20261130/)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from bench.core import memory_categories
from bench.measure.cuda_reduction import ReductionScratch, accumulator_bytes, scratch_bytes
from bench.measure.op_scratch import OperatorScratch

H200 = (132, 2048)
TRACE = (Path(__file__).resolve().parent.parent / "results" / "reference" / "gpu" / "h200-20261130" / "lease1" / "check"
         / "gpt_mini_amp:dtype=bfloat16_train_16.peak.trace.json.gz")


@pytest.mark.parametrize("features", [384, 1152, 1536])
def test_a_bias_gradient_over_4096_tokens_needs_what_the_h200_allocated(features):
    # gpt_mini at batch 16 x 256 tokens: the sum over tokens of each Linear's (tokens, features) gradient
    partials, semaphores = scratch_bytes((16, 256, features), (256 * features, features, 1), [0, 1], 4, H200)
    assert partials == 4 * features * 64 * 32 * 4  # float partials, 64 blocks per output, a block's 32 x 4 outputs
    assert semaphores == 4 * features // 128
    trace = json.load(gzip.open(TRACE))
    reduce_kernel = {event["size"] for event in trace if event["action"] == "alloc"
                     and any("gpu_reduce_kernel" in frame for frame in event["frames"])}
    assert {partials, semaphores} <= reduce_kernel


def test_outputs_reduced_within_one_block_need_nothing():
    assert scratch_bytes((4096, 4096), (4096, 1), [-1], 4, H200) == ()  # a norm's mean over the features
    assert scratch_bytes((64, 16), (16, 1), [0], 4, H200) == ()  # few inputs per output
    assert scratch_bytes((16,), (1,), [], 4, H200) == ()
    assert scratch_bytes((4096, 4096), (4096, 1), [], 4, H200) == (4 * 528, 4)  # a whole tensor: 528 blocks


def test_the_accumulator_and_the_operators_reduced():
    assert accumulator_bytes("sum", torch.bfloat16) == 4 and accumulator_bytes("amax", torch.bfloat16) == 2
    assert accumulator_bytes("sum", torch.float64) == 8 and accumulator_bytes("sum", torch.int32) == 8
    scratch = ReductionScratch((9, 0))
    grad = torch.empty(4096, 1536, dtype=torch.bfloat16)
    assert scratch(torch.ops.aten.sum.dim_IntList, (grad, [0])) == (50_331_648, 48)
    assert scratch(torch.ops.aten.add.Tensor, (grad, grad)) == ()
    assert ReductionScratch(None)(torch.ops.aten.sum.dim_IntList, (grad, [0])) == ()
    assert OperatorScratch((9, 0))(torch.ops.aten.sum.dim_IntList, (grad, [0])) == (
        (50_331_648, memory_categories.REDUCTION_SCRATCH), (48, memory_categories.REDUCTION_SCRATCH))
