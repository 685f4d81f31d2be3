"""bench.jobs' torchtitan and accelerate readers: torchtitan's own TOML job files (copied at the commit their header
names) and an accelerate FSDP2 config read into the case they describe, every key accounted for, bad values refused in
one line with exit code 2; torchtitan's per-operator checkpointing policy; the torchtitan anchors' configurations."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bench.analysis.anchors import ANCHOR_DIR, load_file
from bench.cli.main import main
from bench.core.errors import UsageError
from bench.jobs import derive_job, kind_of_file
from bench.jobs.files import load_file as load_config
from bench.jobs.job import workload_options
from bench.jobs.torchtitan_keys import TORCHTITAN_COMMIT
from strategies import STRATEGIES, parse_strategy

FIXTURES = Path(__file__).parent / "fixtures" / "jobs"
LLAMA3_70B = FIXTURES / "torchtitan_llama3_70b.toml"  # torchtitan's llama3_70b.toml: its header says where from
LLAMA3_8B = ANCHOR_DIR / "configs" / "torchtitan" / "llama3_8b.toml"
ACCELERATE = Path(__file__).parent.parent / "examples" / "configs" / "accelerate" / "fsdp2_bf16.yaml"


def _members(spec: str) -> set[str]:
    return set(parse_strategy(spec).spec().split("+"))


def _fates(job) -> dict[str, str]:
    keys = [use.key for use in job.keys]
    assert len(keys) == len(set(keys)) and all(use.detail for use in job.keys)
    return {use.key: use.fate for use in job.keys}


def test_the_fixture_is_torchtitan_s_own_file_at_the_stated_commit():
    header = LLAMA3_70B.read_text().splitlines()[0]
    assert "pytorch/torchtitan" in header and TORCHTITAN_COMMIT in header and "llama3_70b.toml" in header
    assert kind_of_file(load_config(LLAMA3_70B)) == "torchtitan"


def test_llama3_70b_on_64_ranks_is_fsdp_8_by_tp_8_in_mixed_precision():
    job = derive_job(LLAMA3_70B, ranks=64)
    assert workload_options(job.workload) == ("hf:llama-3.1-70b", {"seq_len": "8192"})
    members = {m.split(":")[0] for m in job.strategy.split("+")}
    assert {"fsdp", "tp", "checkpoint", "optimizer"} == members
    assert "fsdp:param_dtype=bfloat16:reduce_dtype=float32" in job.strategy and "tp:degree=8" in job.strategy
    assert "checkpoint:segments=all" in job.strategy and "optimizer:impl=fused" in job.strategy  # torchtitan's default
    # local_batch_size 8 per data-parallel rank; the 8 ranks of a TP group share theirs: 8 x 8 over the 64 ranks
    assert (job.batch_size, job.ranks, job.global_batch_size) == (8, 64, 64)
    assert "--global-batch-size 64 --ranks 64" in job.command()
    fates = _fates(job)
    assert fates["parallelism.tensor_parallel_degree"] == fates["activation_checkpoint.mode"] == "used"
    assert fates["training.max_norm"] == "not modelled"
    assert fates["optimizer.lr"] == fates["checkpoint.interval"] == fates["validation.freq"] == "ignored"
    assert fates["quantize.linear.float8.filter_fqns"] == "ignored"  # float8 settings without the float8 converter
    assert fates["compile.enable"] == "used" and fates["compile.components"] == "ignored"


def test_llama3_70b_on_run_train_sh_s_8_gpus_has_no_fsdp_and_no_mixed_precision():
    job = derive_job(LLAMA3_70B)  # data_parallel_shard_degree -1 on run_train.sh's NGPU=8: tp 8 leaves shard 1
    assert job.ranks == 8 and "fsdp" not in job.strategy and "amp" not in job.strategy
    assert any("run_train.sh" in line for line in job.assumptions)
    with pytest.raises(UsageError, match="multiple of 8"):
        derive_job(LLAMA3_70B, ranks=12)


def test_llama3_8b_s_selective_op_checkpointing_is_torchtitan_s_policy():
    job = derive_job(LLAMA3_8B)
    assert _members(job.strategy) == _members("selective_checkpoint:policy=every_other_mm+optimizer:impl=fused"
                                              "+fsdp:param_dtype=bfloat16:reduce_dtype=float32")
    assert (job.batch_size, job.ranks, job.global_batch_size) == (1, 8, None)


@pytest.mark.parametrize("overrides, present, absent", [
    (["training.dtype=bfloat16"], {"bf16_weights"}, set()),
    (["activation_checkpoint.mode=none"], set(), {"selective_checkpoint", "checkpoint"}),
    (["activation_checkpoint.selective_ac_option=1"], {"checkpoint:segments=all"}, {"selective_checkpoint"}),
    (["compile.enable=true"], {"compile:scope=layers:loss=true"}, set()),
    (["compile.enable=true", "activation_checkpoint.mode=memory_budget", "activation_checkpoint.memory_budget=0.3"],
     {"compile:budget=0.3:scope=layers:loss=true"}, {"selective_checkpoint"}),
    (["training.enable_cpu_offload=true", "parallelism.fsdp_reshard_after_forward=never"],
     {"fsdp:offload=cpu:reshard_after_forward=false:param_dtype=bfloat16:reduce_dtype=float32"}, set()),
    (["parallelism.data_parallel_replicate_degree=2"], {"fsdp:replicate=2:param_dtype=bfloat16:reduce_dtype=float32"},
     set()),
    (["parallelism.data_parallel_shard_degree=1", "parallelism.data_parallel_replicate_degree=8"],
     {"ddp", "amp:dtype=bfloat16"}, {"fsdp"}),
    (["optimizer.name=Adam", "optimizer.implementation=for-loop", "optimizer.early_step_in_backward=true"],
     {"optimizer:name=adam:impl=for_loop", "optimizer_in_backward"}, set()),
    (["training.global_batch_size=32"], {"grad_accumulation:micro_batches=4"}, set()),
])
def test_each_key_becomes_its_spec_member(overrides, present, absent):
    job = derive_job(LLAMA3_8B, overrides)
    members = _members(job.strategy)
    assert {parse_strategy(m).spec() for m in present} <= members, job.strategy
    assert not {m for m in members for name in absent if m.split(":")[0] == name}
    if "training.global_batch_size=32" in overrides:
        assert job.batch_size == 4  # 32 over 8 data-parallel ranks of local batch 1: 4 accumulated micro-batches


def test_compile_on_a_tensor_parallel_mesh_is_left_out_and_said_not_modelled():
    """torchtitan's 405B file compiles its blocks on an 8-way tp mesh; membench's compile and tp do not compose, so
    the job is predicted without compile (each compile key not modelled), not refused."""
    job = derive_job(LLAMA3_70B, ["compile.enable=true"], ranks=64)
    assert "compile" not in {m.split(":")[0] for m in job.strategy.split("+")} and "tp:degree=8" in job.strategy
    assert "checkpoint:segments=all" in job.strategy
    uses = {use.key: use for use in job.keys}
    for key in ("compile.enable", "compile.components"):  # the file's compile keys (it sets no backend)
        assert uses[key].fate == "not modelled", key
    assert "predicted without compile" in uses["compile.enable"].detail
    budget = derive_job(LLAMA3_70B, ["compile.enable=true", "activation_checkpoint.mode=memory_budget",
                                     "activation_checkpoint.memory_budget=0.3"], ranks=64)
    assert "checkpoint" not in budget.strategy and "compile" not in budget.strategy
    fates = {use.key: use.fate for use in budget.keys}
    assert fates["activation_checkpoint.memory_budget"] == fates["activation_checkpoint.mode"] == "not modelled"
    # without tp the compiler's budget and compile stay (the 8B file)
    assert "compile:budget=0.3" in derive_job(LLAMA3_8B, ["compile.enable=true", "activation_checkpoint.mode="
                                                          "memory_budget", "activation_checkpoint.memory_budget=0.3"]
                                              ).strategy


def test_every_kth_layer_is_not_modelled_and_says_what_is_predicted():
    # float8's keys: tests/test_float8.py
    job = derive_job(LLAMA3_8B, ["activation_checkpoint.selective_ac_option=2"])
    uses = {use.key: use for use in job.keys}
    assert uses["activation_checkpoint.selective_ac_option"].fate == "not modelled"
    assert "under-predicted" in uses["activation_checkpoint.selective_ac_option"].detail


def test_a_strategy_membench_lacks_is_a_refusal_after_the_accounting(monkeypatch, tmp_path, capsys):
    if "tp" in STRATEGIES:  # as before tensor parallelism was registered
        monkeypatch.delitem(STRATEGIES._items, "tp")
    job = derive_job(LLAMA3_70B, ranks=64)
    assert job.unsupported.startswith("not predicted:") and "tp" in job.unsupported
    code = main(["predict", "--config", str(LLAMA3_70B), "--ranks", "64", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 2 and "Traceback" not in captured.err and len(captured.err.strip().splitlines()) == 1
    assert "parallelism.tensor_parallel_degree=8" in captured.out  # every key's fate printed first
    assert not list(tmp_path.glob("predict-*.csv"))


@pytest.mark.parametrize("overrides, expected", [
    (["activation_checkpoint.mode=partial"], "activation_checkpoint.mode: unknown value 'partial'; valid choices"),
    (["training.seq_length=4096"], "key training.seq_length: not a key"),
    (["parallelism.pipeline_parallel_degree=2"], "pipeline_parallel_degree=2: membench has no pipeline"),
    (["model.flavor=13B"], "model.flavor: unknown value '13B'; valid choices: 8B"),
    (["training.seq_len=8191"], "training.seq_len=8191: must be a positive multiple"),
    (["activation_checkpoint.selective_ac_option=some"], "selective_ac_option='some': valid choices: op"),
    (["training.local_batch_size=two"], "training.local_batch_size: 'two' is not a int"),
    (["model.converters=[mx]"], "model.converters: 'mx' is not a converter"),
])
def test_a_bad_torchtitan_value_is_one_line_and_exit_2(tmp_path, capsys, overrides, expected):
    code = main(["predict", "--config", str(LLAMA3_8B), *overrides, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_the_torchtitan_anchors_are_what_their_configuration_derives():
    rows = {row["name"]: row for row in yaml.safe_load((ANCHOR_DIR / "torchtitan.yaml").read_text())["rows"]}
    with_config = [a for a in load_file(ANCHOR_DIR / "torchtitan.yaml") if "config" in rows[a.name]]
    assert len(with_config) == 5
    for anchor in with_config:
        reference = rows[anchor.name]["config"]
        job = derive_job(ANCHOR_DIR / reference["file"], reference["overrides"], ranks=anchor.ranks)
        assert _members(job.strategy) == _members(anchor.strategy), anchor.name
        assert job.batch_size * job.ranks == anchor.global_batch and job.ranks == anchor.ranks
        assert job.workload == f"hf:{anchor.model}:seq_len={anchor.seq_len}"


# --- accelerate ----------------------------------------------------------------------------------------------------

def test_accelerate_s_fsdp2_config_is_fsdp_with_its_mixed_precision_and_needs_the_model():
    assert kind_of_file(load_config(ACCELERATE)) == "accelerate"
    job = derive_job(ACCELERATE, workload="hf:llama-3.1-8b:seq_len=4096")
    assert job.workload == "hf:llama-3.1-8b:seq_len=4096" and job.ranks == 8
    assert _members(job.strategy) == _members("checkpoint:segments=all+amp:dtype=bfloat16+fsdp:param_dtype=bfloat16:"
                                              "reduce_dtype=bfloat16:output_dtype=bfloat16")
    fates = _fates(job)
    assert fates["fsdp_config.fsdp_activation_checkpointing"] == fates["num_processes"] == "used"
    assert fates["fsdp_config.fsdp_state_dict_type"] == fates["tpu_use_sudo"] == "ignored"
    with pytest.raises(UsageError, match="give --workload"):
        derive_job(ACCELERATE)


@pytest.mark.parametrize("overrides, spec", [
    (["fsdp_config.fsdp_reshard_after_forward=false", "fsdp_config.fsdp_offload_params=true", "mixed_precision=no"],
     "checkpoint:segments=all+fsdp:reshard_after_forward=false:offload=cpu"),
    (["fsdp_config.fsdp_version=1", "fsdp_config.fsdp_reshard_after_forward=SHARD_GRAD_OP", "mixed_precision=no"],
     "checkpoint:segments=all+fsdp:reshard_after_forward=false"),
    (["fsdp_config.fsdp_version=1", "fsdp_config.fsdp_reshard_after_forward=HYBRID_SHARD", "num_machines=2",
      "mixed_precision=no"], "checkpoint:segments=all+fsdp:replicate=2"),
    (["distributed_type=MULTI_GPU", "mixed_precision=no"], "ddp"),
    (["mixed_precision=no", "dynamo_config.dynamo_backend=INDUCTOR",
      "dynamo_config.dynamo_use_regional_compilation=true"], "checkpoint:segments=all+compile:scope=layers+fsdp"),
])
def test_accelerate_s_keys_become_their_spec(overrides, spec):
    job = derive_job(ACCELERATE, overrides, workload="hf:llama-3.1-8b")
    assert _members(job.strategy) == _members(spec)


@pytest.mark.parametrize("overrides, expected", [
    (["distributed_type=MEGATRON_LM"], "distributed_type: unknown value 'MEGATRON_LM'; valid choices: FSDP, DEEPSPEED"),
    (["fsdp_config.fsdp_version=3"], "fsdp_config.fsdp_version: unknown value 3; valid choices: 1, 2"),
    (["mixed_precision=fp4"], "mixed_precision: unknown value 'fp4'"),
    (["fsdp_config.fsdp_activation_checkpointing=maybe"], "is not a bool"),
    (["fsdp_config.fsdp_sharding_strategy=FULL_SHARD"], "FSDP1's; with fsdp_version 2"),
])
def test_a_bad_accelerate_value_is_one_line_and_exit_2(tmp_path, capsys, overrides, expected):
    code = main(["predict", "--config", str(ACCELERATE), *overrides, "--workload", "hf:tiny-llama",
                 "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


# --- torchtitan's per-operator policy -------------------------------------------------------------------------------

def test_every_other_mm_saves_the_odd_matmuls_of_each_checkpoint_and_attention():
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    from strategies.selective_checkpoint import every_other_mm_policy

    class Context:
        def __init__(self, is_recompute):
            self.is_recompute = is_recompute

    mm, sdpa, add = (torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_efficient_attention.default,
                     torch.ops.aten.add.Tensor)
    layer = [mm, mm, mm, sdpa, mm, add, mm, mm, mm]  # q k v attention o residual gate up down
    for recompute in (False, True):  # the forward and the recompute count apart, and agree
        policy = every_other_mm_policy()
        saved = [policy(Context(recompute), op) == CheckpointPolicy.MUST_SAVE for op in layer]
        assert saved == [True, False, True, True, False, False, True, False, True]
    fresh = every_other_mm_policy()  # each checkpoint (each layer) starts counting again
    assert fresh(Context(False), mm) == CheckpointPolicy.MUST_SAVE


@pytest.mark.slow  # four tiny-llama steps on the CPU: 30 s on 2 busy cores
def test_every_other_mm_keeps_less_than_saving_every_matmul_and_trains_the_same():
    """On a Llama layer (transformers' tiny-llama, the CPU's exact tracker) the policy saves q, v, gate and down and
    recomputes k, o and up: a peak between saving every matmul and saving nothing, and the baseline's loss and
    gradients (the same float32 arithmetic)."""
    pytest.importorskip("transformers")
    from bench.run.case import Case, bind_case
    from bench.run.runner import memory_pass, run_case

    def case(spec):
        return Case("hf:tiny-llama:seq_len=64", spec, "train", 4, "cpu", data="synthetic", warmup=0, steps=1)

    peaks = {spec: memory_pass(case(spec), bind_case(case(spec))[0])["peak_mem_bytes"]
             for spec in ("selective_checkpoint:policy=none", "selective_checkpoint:policy=every_other_mm",
                          "selective_checkpoint:policy=matmul")}
    assert (peaks["selective_checkpoint:policy=none"] < peaks["selective_checkpoint:policy=every_other_mm"]
            < peaks["selective_checkpoint:policy=matmul"]), peaks
    row = run_case(case("selective_checkpoint:policy=every_other_mm"), env={})
    assert row["status"] == "ok" and row["matches_baseline"] is True, row
