"""float8 (torchao's float8 training of the linear layers) on the CPU, whose `torch._scaled_mm` runs float8: the
prediction on fake tensors equals a real step's live-tensor peak to the byte, and composed with fsdp the one-process
prediction equals 2 real gloo ranks to the byte (with FSDP2's float8 all-gather too); which layers it converts
(torchtitan's filter); the GPUs it refuses; and torchtitan's float8 keys read into its options."""

from __future__ import annotations

import pytest
from torch import nn

from bench.analysis.anchors import ANCHOR_DIR
from bench.analysis.fake_engine import tracked_step
from bench.core.memory_categories import COMMUNICATION
from bench.core.errors import Unsupported, UsageError
from bench.jobs import derive_job
from bench.run.case import Case, bind_case
from bench.run.fake_pass import fake_memory_pass
from bench.run.isolation import RunOptions
from bench.run.ranks import fake_process_group
from bench.run.runner import memory_pass, run_case
from strategies import StepContext, parse_strategy
from workloads import get_workload

float8_training = pytest.importorskip("torchao.float8", reason="float8 needs torchao")

WORKLOAD = "gpt_mini:layers=2:width=32:heads=2:seq_len=16"  # its block's Linears are multiples of 16, its head not
LLAMA3_8B = ANCHOR_DIR / "configs" / "torchtitan" / "llama3_8b.toml"


def _case(spec: str) -> Case:
    return Case(WORKLOAD, spec, "train", 2, "cpu", data="synthetic", warmup=0, steps=1)


@pytest.mark.parametrize("spec", ["float8", "checkpoint+float8:recipe=rowwise"])
def test_the_prediction_on_fake_tensors_is_a_real_float8_step_to_the_byte(spec):
    case = _case(spec)
    strategy = bind_case(case)[0]
    real = memory_pass(case, strategy)
    fake = fake_memory_pass(case, bind_case(case)[0])
    assert fake["peak_mem_bytes"] == real["peak_mem_bytes"] > 0
    assert fake["peak_stage"] == real["peak_stage"]
    # the step ran float8 matmuls: every Linear of the blocks became a Float8Linear (the head, 256 wide, did not)
    float8_layers = next(m for m in getattr(strategy, "members", [strategy]) if m.name == "float8").converted
    model = get_workload(WORKLOAD).model_structure()
    blocks = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name.startswith("blocks.")]
    assert sorted(float8_layers) == sorted(blocks) and blocks


@pytest.mark.slow  # two gloo processes that each import torchao: 20-50 s each; CI runs it with the long tests
@pytest.mark.parametrize("spec", ["fsdp+float8:fsdp_float8_all_gather=true", "fsdp+float8"])
def test_with_fsdp_the_one_process_prediction_equals_real_gloo_ranks_to_the_byte(spec):
    """2 real gloo processes (gloo all-gathers the float8 weights FSDP2 casts before gathering) against each rank
    predicted in one process on PyTorch's fake process group: each rank's peak, and the collectives' buffers."""
    case = Case(WORKLOAD, spec, "train", 4, "cpu", data="synthetic", warmup=0, steps=1)
    measured = run_case(case, env={}, options=RunOptions(threads=1, ranks=2))
    assert measured["status"] == "ok", measured["message"]
    assert "matmuls run in float8" in measured["message"]
    steps = []
    for rank in range(2):
        with fake_process_group(2, rank):
            steps.append(tracked_step(case, spec, "cpu", ranks=2, cuda_autocast=False))
    assert sorted(step.peak_bytes for step in steps) == [measured["rank_peak_min_bytes"],
                                                         measured["rank_peak_max_bytes"]]
    largest = max(steps, key=lambda step: step.peak_bytes).peak_by_category
    assert largest[COMMUNICATION] == measured["peak_communication_bytes"] > 0


def test_the_layers_converted_are_torchtitan_s_filter():
    workload = get_workload(WORKLOAD)
    model = workload.model_structure()
    strategy = parse_strategy("float8")
    strategy.bind(StepContext("train", "cpu", workload, 2))
    head = workload.output_head(model)
    prepared = strategy.prepare_model(model, workload.checkpoint_units(model))
    kinds = {name: type(m).__name__ for name, m in prepared.named_modules() if isinstance(m, nn.Linear)}
    assert kinds.pop(next(n for n, m in prepared.named_modules() if m is head)) == "Linear"  # the head is left out
    assert set(kinds.values()) == {"Float8Linear"}
    # head=true converts the head too, where its dimensions are multiples of 16 (a vocabulary of 256 is)
    with_head = parse_strategy("float8:head=true")
    with_head.bind(StepContext("train", "cpu", workload, 2))
    with_head.prepare_model(workload.model_structure(), [])
    assert len(with_head.converted) == len(kinds) + 1


def test_a_model_with_no_linear_to_convert_is_refused_saying_so():
    workload = get_workload("deep_mlp:layers=3:width=8")  # 8 features: no dimension a multiple of 16
    strategy = parse_strategy("float8")
    strategy.bind(StepContext("train", "cpu", workload, 2))
    with pytest.raises(Unsupported, match="float8 has no linear layer to convert in train"):
        strategy.check(strategy.context)  # before any model is built, from the model's structure


@pytest.mark.parametrize("capability, refused", [((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)])
def test_a_gpu_below_compute_capability_8_9_is_refused(capability, refused):
    strategy = parse_strategy("float8")
    context = StepContext("train", "cuda", None, 2, capability=capability)
    if refused:
        with pytest.raises(Unsupported, match=rf"8\.9 or later .* the GPU's is {capability[0]}\.{capability[1]}"):
            strategy.check(context)
    else:
        strategy.check(context)


def test_bad_options_are_refused_in_one_line():
    with pytest.raises(UsageError, match="valid choices: tensorwise, rowwise, rowwise_with_gw_hp"):
        parse_strategy("float8:recipe=blockwise")
    with pytest.raises(UsageError, match="valid: recipe=tensorwise"):
        parse_strategy("float8:recipe=rowwise:fsdp_float8_all_gather=true")


def _uses(job) -> dict[str, tuple[str, str]]:
    return {use.key: (use.fate, use.detail) for use in job.keys}


def test_torchtitan_s_float8_converter_becomes_float8_with_its_options():
    job = derive_job(LLAMA3_8B, ["model.converters=[float8]"])  # filter_fqns = ["output"], FSDP over 8 ranks
    assert "float8+" in job.strategy and not job.unsupported
    assert parse_strategy(job.strategy).spec() == job.strategy
    uses = _uses(job)
    assert uses["model.converters"][0] == uses["quantize.linear.float8.filter_fqns"][0] == "used"
    assert uses["quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"][0] == "ignored"  # false

    job = derive_job(LLAMA3_8B, ["model.converters=[float8]", "quantize.linear.float8.filter_fqns=[]",
                                 "quantize.linear.float8.enable_fsdp_float8_all_gather=true",
                                 "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp=true"])
    float8 = next(m for m in job.strategy.split("+") if m.startswith("float8"))
    assert parse_strategy(float8).settings == {**parse_strategy("float8").settings, "head": True,
                                               "fsdp_float8_all_gather": True}
    uses = _uses(job)
    assert uses["quantize.linear.float8.enable_fsdp_float8_all_gather"][0] == "used"
    assert uses["quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"][0] == "not modelled"

    job = derive_job(LLAMA3_8B, ["model.converters=[float8]", "quantize.linear.float8.recipe_name=rowwise",
                                 "quantize.linear.float8.filter_fqns=[output,attention.wq]"])
    assert "float8:recipe=rowwise" in job.strategy
    fate, detail = _uses(job)["quantize.linear.float8.filter_fqns"]
    assert fate == "not modelled" and "attention.wq" in detail


def test_torchtitan_s_float8_keys_that_cannot_go_together_or_without_the_converter():
    with pytest.raises(UsageError, match="recipe_name=rowwise: torchtitan refuses it together"):
        derive_job(LLAMA3_8B, ["model.converters=[float8]", "quantize.linear.float8.recipe_name=rowwise",
                               "quantize.linear.float8.enable_fsdp_float8_all_gather=true"])
    job = derive_job(LLAMA3_8B)  # no converter: the section's keys are ignored
    assert "float8" not in job.strategy
    assert _uses(job)["quantize.linear.float8.filter_fqns"][0] == "ignored"
    # with tensor parallelism torchtitan uses torchao's float8 TP plans, which membench does not compose
    job = derive_job(LLAMA3_8B, ["model.converters=[float8]", "parallelism.tensor_parallel_degree=2"])
    assert "float8" not in job.strategy and _uses(job)["model.converters"][0] == "not modelled"


def test_a_rowwise_prediction_says_which_gpus_run_it_in_float32():
    assert parse_strategy("float8").prediction_note is None
    note = parse_strategy("float8:recipe=rowwise").prediction_note
    assert "compute capability 9.x only" in note and "16-bit inputs" in note
