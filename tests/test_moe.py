"""Mixture-of-experts decoders of the `hf:` workload (workloads/framework/hf_moe.py): the presets' published numbers,
the experts implementation the models run, the CPU count against the literal training loop and against the fake engine
to the byte, the memory's independence from the routing, and the router's and dispatch's own lines in the breakdown.

Small: full-size models are built on the meta device only; the steps run tiny-mixtral, tiny-qwen3-moe and tiny-olmoe
(2 layers, 4-8 experts, widths of 16-64) at 32-64 tokens, where the peak falls in the backward with the experts'
dispatch buffers alive. tests_cuda_fake/test_moe_full_size.py predicts the full-size models.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from bench.analysis import fake_engine, predict
from bench.analysis.explain import explain
from bench.core.memory_categories import MOE_DISPATCH, MOE_ROUTER
from bench.measure import breakdown
from bench.run.case import Case, bind_case
from bench.run.runner import memory_pass
from conformance import MEASURED_STEP, literal_loop_peak
from workloads.framework import hf_moe
from workloads.framework.hf_presets import PRESETS, PUBLISHED_PARAMETERS
from workloads.framework.loader import resolve_workload

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="transformers is not installed (make install installs membench[hf])"),
              pytest.mark.usefixtures("one_thread")]

FULL_SIZE = {"mixtral-8x7b": (8, 2), "qwen3-30b-a3b": (128, 8)}  # experts per layer, experts per token
# (spec, batch): each tiny MoE preset where its train peak falls in the backward, dispatch buffers alive
TINY = [("hf:tiny-mixtral:seq_len=64", 4), ("hf:tiny-qwen3-moe:seq_len=64", 4), ("hf:tiny-olmoe:seq_len=32", 4)]


def cpu_case(spec: str, batch: int, data: str = "synthetic", strategy: str = "baseline") -> Case:
    return Case(spec, strategy, "train", batch, "cpu", data=data, warmup=0, steps=1)


def cpu_memory(spec: str, batch: int, data: str = "synthetic") -> dict:
    case = cpu_case(spec, batch, data)
    return memory_pass(case, bind_case(case)[0])


# --- the presets -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", sorted(FULL_SIZE))
def test_a_full_size_moe_preset_has_its_published_experts_and_parameters(preset):
    workload = resolve_workload(f"hf:{preset}")
    model = workload.model_structure()  # on the meta device: 187 GB of float32 weights for Mixtral, none held
    assert next(model.parameters()).is_meta
    split = hf_moe.parameter_split(model)
    assert split["total"] == PUBLISHED_PARAMETERS[preset]
    experts, per_token = FULL_SIZE[preset]
    config = model.config
    assert hf_moe.expert_count(config) == experts and config.num_experts_per_tok == per_token
    blocks = hf_moe.moe_blocks(model)
    assert len(blocks) == config.num_hidden_layers  # every layer routes (Qwen3's decoder_sparse_step 1)
    width = PRESETS[preset].get("moe_intermediate_size", PRESETS[preset]["intermediate_size"])
    hidden = config.hidden_size
    assert split["experts"] == config.num_hidden_layers * experts * 3 * hidden * width  # gate, up and down
    assert split["router"] == config.num_hidden_layers * experts * hidden
    _, experts_module, router = blocks[0]
    assert experts_module.gate_up_proj.shape == (experts, 2 * width, hidden)
    assert router.weight.shape == (experts, hidden)


@pytest.mark.parametrize("spec,batch", TINY)
def test_the_models_run_transformers_default_grouped_experts(spec, batch):
    model = resolve_workload(spec).build_model()
    assert model.config._experts_implementation == hf_moe.EXPERTS_IMPLEMENTATION == "grouped_mm"
    assert hf_moe.moe_blocks(model) and all(router is not None for _, _, router in hf_moe.moe_blocks(model))


def test_a_copy_of_the_model_runs_its_own_experts():
    # the router's and experts' filing is hooks, not a wrapped forward that a copy would share with the original
    import copy

    workload = resolve_workload(TINY[0][0])
    model = workload.build_model()
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for _, experts, _ in hf_moe.moe_blocks(clone):
            experts.down_proj.zero_()
    inputs, _ = workload.make_batch(1, "synthetic")
    with torch.no_grad():
        assert not torch.equal(workload.run_model(model, inputs), workload.run_model(clone, inputs))


def test_a_model_whose_experts_follow_the_routing_is_said_to():
    workload = resolve_workload(TINY[0][0])
    model = workload.model_structure()
    assert "no routing is assumed" in hf_moe.routing_note(model.config, model)
    model.set_experts_implementation("eager")  # transformers' loop over the experts hit: sized by the routing
    note = hf_moe.routing_note(model.config, model)
    assert "run by eager, whose buffers are sized by the routing" in note and "no routing is assumed" not in note


def test_dense_models_are_not_moe_and_are_left_unchanged():
    model = resolve_workload("hf:tiny-llama:seq_len=8").build_model()
    assert not hf_moe.is_moe(model.config) and hf_moe.moe_blocks(model) == []
    assert resolve_workload("hf:tiny-llama:seq_len=8").prediction_note() is None


@pytest.mark.parametrize("change,words", [
    ({"num_experts_per_tok": 5}, ["num_experts_per_tok = 5 with num_local_experts = 4", "1 to num_local_experts"]),
    ({"num_experts_per_tok": "2"}, ["num_experts_per_tok = '2' (str)", "integer from 1"]),
    ({"num_local_experts": 0}, ["num_experts_per_tok = 2 with num_local_experts = 0"]),
])
def test_a_bad_moe_value_in_a_config_file_is_one_line(tmp_path, change, words):
    from bench.core.errors import UsageError

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**PRESETS["tiny-mixtral"], **change}))
    with pytest.raises(UsageError) as error:
        resolve_workload(f"hf:{path}").build_model()
    message = str(error.value)
    assert all(word in message for word in words) and "\n" not in message, message


# --- the CPU count, exact ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,batch", TINY)
def test_the_cpu_count_is_the_literal_training_loops_to_the_byte(spec, batch):
    """The baseline's train peak is that of the user's loop (model(**x), loss, backward, AdamW step) counted by
    PyTorch's MemTracker (tests/test_loop_lifetimes.py), with the router choosing real experts on real tokens."""
    measured = cpu_memory(spec, batch)
    assert measured["peak_stage"] == "backward"
    assert measured["peak_mem_bytes"] == literal_loop_peak(spec, batch, "train", MEASURED_STEP)


@pytest.mark.parametrize("spec,batch", TINY)
def test_fake_tensors_count_what_the_cpu_counts_without_knowing_the_routing(spec, batch):
    """On fake tensors no expert is chosen (the router's top-k has no values); the grouped experts' buffers have
    tokens x experts-per-token rows whatever the choice, so the count is the CPU's, category by category."""
    case = cpu_case(spec, batch)
    real = memory_pass(case, bind_case(case)[0])
    fake = fake_engine.tracked_step(case, "baseline", engine="fake", block_bytes=1, cuda_autocast=False)
    assert fake.peak_bytes == real["peak_mem_bytes"]
    for category in (MOE_DISPATCH, MOE_ROUTER):  # (the fake engine also files the logits apart: not compared)
        assert fake.peak_by_category[category] == real.tracker.peak_by_category[category] > 0, category


# two more families, as config files: shared experts beside the routed ones (Qwen2-MoE's gated one, DeepSeek-V3's),
# DeepSeek-V3's group-limited routing and its first layer dense
OTHER_FAMILIES = {
    "qwen2_moe": {"model_type": "qwen2_moe", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
                  "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2,
                  "max_position_embeddings": 128, "bos_token_id": 0, "eos_token_id": 1},
    "deepseek_v3": {"model_type": "deepseek_v3", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
                    "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
                    "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": None,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "max_position_embeddings": 128,
                    "bos_token_id": 0, "eos_token_id": 1},
}


@pytest.mark.parametrize("family", sorted(OTHER_FAMILIES))
def test_other_families_from_a_config_file_are_counted_on_fake_tensors_as_on_the_cpu(tmp_path, family):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(OTHER_FAMILIES[family]))
    spec = f"hf:{path}:seq_len=32"
    case = cpu_case(spec, 4)
    real = memory_pass(case, bind_case(case)[0])
    fake = fake_engine.tracked_step(case, "baseline", engine="fake", block_bytes=1, cuda_autocast=False)
    assert real["peak_stage"] == "backward" and fake.peak_bytes == real["peak_mem_bytes"]
    assert real.tracker.peak_by_category[MOE_DISPATCH] > 0


def test_the_routers_load_balancing_loss_is_counted_on_fake_tensors_as_on_the_cpu(tmp_path):
    # output_router_logits: every layer's router logits kept for the auxiliary loss, which the model's own loss
    # (loss=model, as the Trainer trains) adds to the cross-entropy
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**PRESETS["tiny-mixtral"], "output_router_logits": True}))
    peaks = {}
    for spec in (f"hf:{path}:seq_len=32:loss=model", "hf:tiny-mixtral:seq_len=32:loss=model"):
        case = cpu_case(spec, 2)
        peaks[spec] = real = memory_pass(case, bind_case(case)[0])["peak_mem_bytes"]
        assert fake_engine.tracked_step(case, "baseline", engine="fake", block_bytes=1,
                                        cuda_autocast=False).peak_bytes == real
    assert len(set(peaks.values())) == 2  # the auxiliary loss is a step of its own


def _routes(spec: str, batch: int, data: str) -> list[torch.Tensor]:
    """How many tokens each expert of each layer gets for the batch of `data` (the routers' top-k choices)."""
    workload = resolve_workload(spec)
    torch.manual_seed(0)
    model = workload.build_model()
    counts = []

    def count(module, args, output):
        counts.append(torch.bincount(output[2].flatten(), minlength=module.num_experts))

    for _, _, router in hf_moe.moe_blocks(model):
        router.register_forward_hook(count)
    inputs, _ = workload.make_batch(batch, data)
    with torch.no_grad():
        workload.run_model(model, inputs)
    return counts


def test_the_peak_does_not_depend_on_which_experts_the_tokens_go_to():
    spec, batch = TINY[0]
    text, synthetic = _routes(spec, batch, "text"), _routes(spec, batch, "synthetic")
    assert any(not torch.equal(a, b) for a, b in zip(text, synthetic))  # the routing differs...
    assert any(int(c.max()) > 2 * int(c.min()) for c in text + synthetic)  # ...and is not balanced
    peaks = {data: cpu_memory(spec, batch, data)["peak_mem_bytes"] for data in ("text", "synthetic")}
    assert peaks["text"] == peaks["synthetic"], peaks  # ...and the peak is the same


# --- the grouped product on meta and fake tensors ---------------------------------------------------------------

def test_grouped_products_without_values_have_the_cpu_kernels_output_and_keep_torchs_checks():
    from torch._subclasses.fake_tensor import FakeTensorMode

    hf_moe.register_grouped_mm_meta_kernel()
    experts, rows, inner, outer = 4, 10, 12, 20

    def step(device="cpu", dtype=torch.float32, inner=inner):
        """A grouped product of 4 experts' weights (stored transposed, as transformers stores them) and its
        backward: (the product, the weights' gradient)."""
        offsets = torch.tensor([3, 5, 5, 10], dtype=torch.int32, device=device)
        a = torch.randn(rows, inner, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(experts, outer, inner, device=device, dtype=dtype, requires_grad=True)
        out = torch.nn.functional.grouped_mm(a, w.transpose(-2, -1), offs=offsets)
        (out * 2).sum().backward()
        return out, w.grad

    real = step()
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = step()
        with pytest.raises(RuntimeError, match="16 bytes"):  # bfloat16: torch's own meta kernel and its checks
            step(dtype=torch.bfloat16, inner=6)
    for without_values in (fake, step("meta")):
        for got, expected in zip(without_values, real):
            assert (got.shape, got.stride(), got.dtype) == (expected.shape, expected.stride(), expected.dtype)
            assert got.untyped_storage().nbytes() == expected.untyped_storage().nbytes()


# --- the breakdown -----------------------------------------------------------------------------------------------

def test_the_router_and_the_dispatch_are_activations_filed_apart():
    spec, batch = TINY[0]
    measured = cpu_memory(spec, batch)
    tracker = measured.tracker
    parts = {category: tracker.peak_by_category.get(category, 0) for category in (MOE_DISPATCH, MOE_ROUTER)}
    assert parts[MOE_DISPATCH] > 0 and parts[MOE_ROUTER] > 0, tracker.peak_by_category
    # filed apart, counted in the activations column (no column of their own), and the columns add up
    assert measured["peak_activations_bytes"] >= parts[MOE_DISPATCH] + parts[MOE_ROUTER]
    assert sum(measured[column] for column in breakdown.BREAKDOWN_COLUMNS) == measured["peak_mem_bytes"]
    assert breakdown.predicted_columns(parts)["predicted_activations_bytes"] == sum(parts.values())
    # at 2 experts per token, the tokens' sorted copies alone are 2 x tokens x hidden floats, per layer
    assert parts[MOE_DISPATCH] >= 2 * batch * 64 * 32 * 4


def test_a_prediction_says_how_tokens_are_routed_and_what_the_parts_are():
    spec, batch = TINY[0]
    (row,) = predict.predict_cases([Case(spec, "baseline", "train", batch, "cpu", data="synthetic")], engine="fake")
    assert row["status"] == "ok", row
    message = row["message"]
    assert "grouped_mm" in message and "no routing is assumed" in message
    assert "MoE dispatch buffers" in message and "MoE router outputs" in message
    workload = resolve_workload(spec)
    split = hf_moe.parameter_split(workload.model_structure())
    assert f"experts' weights {split['experts']:,} of {split['total']:,} parameters" in message


def test_explain_has_a_line_for_each_router_and_experts_module():
    spec, batch = TINY[0]
    case = cpu_case(spec, batch)
    result = explain(case, bind_case(case)[0])
    rows = {row.name: row for row in result["modules"]}
    for layer in (0, 1):
        router, experts = rows[f"model.layers.{layer}.mlp.gate"], rows[f"model.layers.{layer}.mlp.experts"]
        assert (router.kind, experts.kind) == ("MixtralTopKRouter", "MixtralExperts")
        assert experts.after - experts.before > 0 and experts.peak_within >= experts.after - experts.before
        assert experts.output_bytes == batch * 64 * 32 * 4  # tokens x hidden, back in token order
