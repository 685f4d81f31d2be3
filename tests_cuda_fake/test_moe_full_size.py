"""predict on fake CUDA for mixture-of-experts decoders at full size: Mixtral 8x7B (46.7B parameters) and
Qwen3-30B-A3B (30.5B) from their presets, OLMoE-1B-7B from a config.json (the third family, read as a user's file).
Their weights never exist (187 GB of float32 for Mixtral), every layer is traced, the experts run transformers'
grouped_mm on fake tensors (workloads/framework/hf_moe.py: no routing needed, none assumed), and the router's and the
dispatch's bytes at the peak are named in the row.

Short sequences keep each case to seconds; the whole-step checks (weights, gradients, AdamW's state) are the same at
any length. tests/test_moe.py checks the same path against the CPU, to the byte, at small size.
"""

from __future__ import annotations

import json
import resource

import pytest

from bench.analysis import predict
from bench.measure import cuda_allocator
from bench.run.case import Case
from workloads.framework.hf_presets import PUBLISHED_PARAMETERS
from workloads.framework.loader import resolve_workload

# OLMoE-1B-7B-0924's shape fields (its config.json, https://huggingface.co/allenai/OLMoE-1B-7B-0924, as other projects'
# test fixtures quote it: the file itself was not read here), the rest OlmoeConfig's defaults; the 6,919,161,856
# parameters they make agree with the paper's "6.9B total" (Muennighoff et al. 2024, arXiv:2409.02060)
OLMOE_1B_7B = {"model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "vocab_size": 50304, "hidden_size": 2048,
               "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16,
               "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False}
OLMOE_PARAMETERS = 6_919_161_856


def allocator_blocks_of_weights(spec: str) -> int:
    """The float32 weights' bytes as the caching allocator's model hands them out: a tensor over 10 MiB gets a
    segment rounded up to 2 MiB, whose rest stays in its block when it is not more than 1 MiB (Qwen3's 151,936 x
    2048 vocabulary matrices, 1,187 MiB each, get 1,188 MiB); every other tensor here is a multiple of 512 bytes."""
    model = resolve_workload(spec).model_structure()
    total = 0
    for parameter in model.parameters():
        nbytes = parameter.numel() * 4
        if nbytes > cuda_allocator.K_MIN_LARGE_ALLOC:
            segment = -(-nbytes // cuda_allocator.K_ROUND_LARGE) * cuda_allocator.K_ROUND_LARGE
            nbytes = segment if segment - nbytes <= cuda_allocator.K_SMALL_SIZE else nbytes
        total += nbytes
    return total


def predicted(spec: str, strategy: str) -> tuple[dict, int]:
    """(the row of one train step at batch 1 on fake CUDA, how many bytes this process grew by)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    (row,) = predict.predict_cases([Case(spec, strategy, "train", 1, "cuda", data="synthetic")])
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert row["status"] == "ok" and row["engine"] == "fake-cuda", row
    return row, grown


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_a_full_size_moe_preset_is_predicted_without_its_memory(preset):
    # the baseline's peak is AdamW's step: weights, gradients and two moments of every expert, all float32 (the
    # gradients and moments made during the step, in blocks the allocator model may round up or leave unsplit)
    row, grown = predicted(f"hf:{preset}:seq_len=64", "baseline")
    exact = PUBLISHED_PARAMETERS[preset] * 4
    weights = allocator_blocks_of_weights(f"hf:{preset}")
    assert 0 <= weights - exact <= 2 * cuda_allocator.K_SMALL_SIZE
    assert row["predicted_weights_bytes"] == weights
    assert 0 <= row["predicted_grads_bytes"] - exact < exact / 1000
    assert 0 <= row["predicted_optimizer_state_bytes"] - 2 * exact < 2 * exact / 1000
    assert "grouped_mm" in row["message"] and "no routing is assumed" in row["message"]
    assert grown < 2 * 2**30, grown  # a process that held the weights would have grown by 187 GB (Mixtral)


def test_the_dispatch_buffers_and_router_outputs_are_named_at_a_backward_peak():
    # LoRA (q and v adapters) with every layer checkpointed: the peak falls in the backward, where one layer's
    # recomputed forward holds its dispatch buffers: at least the tokens' copies sorted by expert (tokens x 2
    # experts x 4096 floats) and the first grouped product's output (tokens x 2 x 2 * 14336 floats)
    tokens = 512
    row, _ = predicted(f"hf:mixtral-8x7b:seq_len={tokens}", "lora+checkpoint:segments=all")
    message = row["message"]
    assert "MoE dispatch buffers" in message and "MoE router outputs" in message, message
    dispatch = int(message.split("MoE dispatch buffers ")[1].split(" B")[0].replace(",", ""))
    assert dispatch >= tokens * 2 * (4096 + 2 * 14336) * 4
    assert dispatch <= row["predicted_activations_bytes"]


def test_a_third_family_from_a_config_file_is_predicted_at_full_size(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(OLMOE_1B_7B))
    row, grown = predicted(f"hf:{path}:seq_len=64", "baseline")
    weights = allocator_blocks_of_weights(f"hf:{path}")  # its 50,304 x 2048 matrices 393 MiB: 394 in blocks
    assert row["predicted_weights_bytes"] == weights
    assert 0 <= weights - OLMOE_PARAMETERS * 4 <= 2 * cuda_allocator.K_SMALL_SIZE
    assert "64 experts per layer, 8 per token" in row["message"]
    assert grown < 2 * 2**30, grown
