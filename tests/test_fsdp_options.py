"""FSDP2's options (`fsdp:replicate=R`, `fsdp:offload=cpu`, `fsdp:reshard_after_forward=false`, the mixed-precision
policy's `param_dtype`, `reduce_dtype`, `output_dtype`, `cast_forward_inputs`), predicted per rank in one process
(PyTorch's fake process group, CPU engine): what each keeps per rank, and the refusals of bad values. Their
real-rank equality to the byte is in test_ranks.py, their CUDA path (offload, bfloat16 all-gathers) in
tests_cuda_fake."""

from __future__ import annotations

import pytest

from bench.analysis.predict import predict_case
from bench.run.case import Case
from cli_helpers import main_in_process, one_line_exit_2

UNIFORM = "deep_mlp:layers=24:width=8"  # equal layers: every rank's shard of every parameter is the same size
GPT = "gpt_mini:layers=2:width=32:heads=2:seq_len=16:dropout=0.0"


def _predicted(spec: str, ranks: int, workload: str = UNIFORM, batch: int = 8, device: str = "cpu") -> dict:
    row = predict_case(Case(workload, spec, "train", batch, device, data="synthetic", warmup=0, steps=1),
                       engine="cpu", ranks=ranks)
    return row


@pytest.mark.parametrize("spec,named", [("fsdp:offload=gpu", ["'gpu'", "none, cpu"]),
                                        ("fsdp:replicate=0", ["replicate=0", "at least 1"]),
                                        ("fsdp:reshard_after_forward=sometimes", ["'sometimes'", "bool"]),
                                        ("fsdp:param_dtype=bf16", ["'bf16'", "none, float32, bfloat16, float16"]),
                                        ("fsdp:reduce_dtype=fp32", ["'fp32'", "none, float32, bfloat16, float16"])])
def test_a_bad_option_value_is_one_line_and_exit_2(spec, named, tmp_path):
    done = main_in_process("predict", "--workload", UNIFORM, "--strategies", spec, "--ranks", "2", "--device", "cpu",
                           "--phases", "train", "--batch-size", "4", "--out", tmp_path)
    one_line_exit_2(done, *named)


def test_replica_groups_must_divide_the_ranks_and_offload_needs_a_gpu():
    row = _predicted("fsdp:replicate=3", 2)
    assert row["status"] == "unsupported" and "valid choices: 1, 2" in row["message"], row
    row = _predicted("fsdp:offload=cpu", 2)
    assert row["status"] == "unsupported" and "needs device cuda" in row["message"], row


def test_hybrid_sharding_keeps_what_full_sharding_over_its_replica_group_keeps():
    """HSDP on 4 ranks as 2 replica groups of 2 shards each: every rank holds half of each parameter and of Adam's
    state, exactly what full sharding over 2 ranks holds, more than full sharding over 4 holds (about twice:
    torch.chunk's pieces of an uneven first dimension are not halves)."""
    hsdp = _predicted("fsdp:replicate=2", 4)
    over_two, over_four = _predicted("fsdp", 2), _predicted("fsdp", 4)
    for row in (hsdp, over_two, over_four):
        assert row["status"] == "ok", row["message"]
    assert hsdp["predicted_optimizer_state_bytes"] == over_two["predicted_optimizer_state_bytes"]
    assert 1.5 * over_four["predicted_optimizer_state_bytes"] < hsdp["predicted_optimizer_state_bytes"]
    # the sharded weights as the optimizer state's half (Adam: 2 moments), plus the same unit in flight
    assert hsdp["predicted_weights_bytes"] == over_two["predicted_weights_bytes"]
    assert hsdp["predicted_weights_bytes"] > over_four["predicted_weights_bytes"]


def test_keeping_units_unsharded_after_forward_holds_more_weights():
    default, kept = _predicted("fsdp", 2, GPT, 4), _predicted("fsdp:reshard_after_forward=false", 2, GPT, 4)
    assert default["status"] == kept["status"] == "ok", (default["message"], kept["message"])
    assert kept["predicted_weights_bytes"] > default["predicted_weights_bytes"]
    assert kept["predicted_bytes"] > default["predicted_bytes"]


@pytest.mark.parametrize("spec,sixteen_bit", [("fsdp", False), ("fsdp:param_dtype=float32", False),
                                              ("fsdp:param_dtype=bfloat16:reduce_dtype=float32", True),
                                              ("fsdp:reduce_dtype=float16", True), ("fsdp:output_dtype=bfloat16", True),
                                              ("fsdp:param_dtype=bfloat16+checkpoint", True)])
def test_a_16_bit_dtype_is_verified_with_amps_tolerance_and_plain_fsdp_stays_exact(spec, sixteen_bit):
    from strategies.amp import Amp
    from strategies import EXACT
    from strategies import parse_strategy

    assert parse_strategy(spec).tolerance == (Amp.tolerance if sixteen_bit else EXACT)


def test_bfloat16_parameters_hold_half_the_unsharded_weights_and_the_float32_shards():
    """On the CPU engine, FSDP2 in bfloat16 keeps the same float32 shards and optimizer state as plain FSDP2, and
    fewer weights at the peak (its units in flight at 2 bytes a parameter, not 4)."""
    plain, mixed = _predicted("fsdp", 2, GPT, 4), _predicted("fsdp:param_dtype=bfloat16:reduce_dtype=float32", 2, GPT, 4)
    assert plain["status"] == mixed["status"] == "ok", (plain["message"], mixed["message"])
    assert mixed["predicted_optimizer_state_bytes"] == plain["predicted_optimizer_state_bytes"]
    shards = plain["predicted_optimizer_state_bytes"] // 2  # about: Adam keeps 2 moments of the float32 shards
    assert shards < mixed["predicted_weights_bytes"] < plain["predicted_weights_bytes"]
    assert mixed["predicted_bytes"] < plain["predicted_bytes"]
