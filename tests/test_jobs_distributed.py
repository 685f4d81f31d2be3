"""accelerate's DeepSpeed plugin and axolotl's `deepspeed`/`fsdp_config` keys read into the strategies a DeepSpeed JSON
or FSDP gives (bench/jobs/accelerate_deepspeed.py, bench/jobs/axolotl_distributed.py): the strategy each example
yields, that both routes to a ZeRO stage give what the same DeepSpeed JSON gives read alone, every key accounted for,
and bad values refused in one line with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli.main import main
from bench.jobs import derive_job, kind_of_file
from bench.jobs.files import load_file
from bench.jobs.job import IGNORED, NOT_MODELLED, USED, spec_of

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "configs"
PLUGIN = EXAMPLES / "accelerate" / "deepspeed_zero3.yaml"
PLUGIN_FILE = EXAMPLES / "accelerate" / "deepspeed_config_file.yaml"
AXOLOTL = EXAMPLES / "axolotl" / "llama_8b_zero3.yaml"
DS_JSON = EXAMPLES / "deepspeed" / "ds_zero3.json"
MODEL = "hf:llama-3.1-8b:seq_len=2048"
HIDDEN = 4096  # llama-3.1-8b's: "auto" bucket sizes are hidden x hidden, 0.9 of that, 10 x hidden
AUTO_SIZES = (f"reduce_bucket_size={HIDDEN * HIDDEN}:prefetch_bucket_size={int(0.9 * HIDDEN * HIDDEN)}:"
              f"param_persistence_threshold={10 * HIDDEN}")


def _fates(job) -> dict[str, str]:
    keys = [use.key for use in job.keys]
    assert len(keys) == len(set(keys)) and all(use.detail for use in job.keys)
    return {use.key: use.fate for use in job.keys}


def _alone(values: dict) -> str:
    """The strategy a DeepSpeed JSON of `values` gives read alone."""
    return derive_job(values, model=MODEL).strategy


# --- accelerate's DeepSpeed plugin -----------------------------------------------------------------------------------

def test_the_plugin_section_is_the_zero_stage_the_same_deepspeed_json_gives():
    assert kind_of_file(load_file(PLUGIN)) == "accelerate"
    job = derive_job(PLUGIN, workload=MODEL)
    assert job.ranks == 8 and job.batch_size == 4  # the script's batch 1 x 4 accumulated micro-batches
    same = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    assert job.strategy == _alone(same) == "bf16_weights+grad_accumulation:micro_batches=4+zero3:offload_optimizer=cpu"
    assert "amp" not in job.strategy  # accelerate adds no autocast under DeepSpeed
    fates = _fates(job)
    assert fates["deepspeed_config.zero_stage"] == fates["mixed_precision"] == fates["distributed_type"] == USED
    assert fates["deepspeed_config.gradient_clipping"] == NOT_MODELLED
    assert fates["deepspeed_config.zero3_init_flag"] == fates["deepspeed_config.zero3_save_16bit_model"] == IGNORED


@pytest.mark.parametrize("overrides, same", [
    (["~deepspeed_config.zero_stage", "mixed_precision=no", "~deepspeed_config.gradient_accumulation_steps"],
     {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}),  # accelerate's default stage 2
    (["deepspeed_config.offload_param_device=cpu", "deepspeed_config.offload_optimizer_device=none",
      "mixed_precision=fp16", "deepspeed_config.gradient_accumulation_steps=1"],
     {"fp16": {"enabled": True}, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}),
    (["deepspeed_config.zero_stage=2", "deepspeed_config.offload_param_device=cpu", "mixed_precision=fp8",
      "deepspeed_config.gradient_accumulation_steps=2"],
     {"bf16": {"enabled": True}, "gradient_accumulation_steps": 2,
      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}),
])
def test_each_plugin_key_gives_what_its_deepspeed_json_gives(overrides, same):
    job = derive_job(PLUGIN, overrides, workload=MODEL)
    assert job.strategy == _alone({"train_micro_batch_size_per_gpu": 1, **same})


def test_stages_0_and_1_are_named_as_ddp_and_zero1_without_their_offload():
    job = derive_job(PLUGIN, ["deepspeed_config.zero_stage=1", "deepspeed_config.offload_param_device=cpu"],
                     workload=MODEL)
    assert job.strategy == "bf16_weights+grad_accumulation:micro_batches=4+zero1"
    fates = _fates(job)
    assert fates["deepspeed_config.zero_stage"] == fates["deepspeed_config.offload_optimizer_device"] == NOT_MODELLED
    assert fates["deepspeed_config.offload_param_device"] == IGNORED


def test_a_deepspeed_config_file_is_read_key_by_key_with_accelerates_auto():
    job = derive_job(PLUGIN_FILE, workload=MODEL)
    assert job.ranks == 8 and job.batch_size == 1
    # "auto": the script's batch 1, accumulation 1, bf16 off (no --mixed_precision), buckets from the hidden size
    assert job.strategy == f"zero3:{AUTO_SIZES}"
    fates = _fates(job)
    ds_keys = [k for k in fates if k.startswith("deepspeed_config_file.")]
    flat = json.loads(DS_JSON.read_text())
    assert len(ds_keys) == len(flat) - 1 + len(flat["zero_optimization"])  # every key of the JSON accounted for
    assert fates["deepspeed_config_file.zero_optimization.stage3_max_reuse_distance"] == USED
    assert fates["deepspeed_config.deepspeed_config_file"] == USED


def test_a_config_files_own_micro_batch_and_accumulation_are_the_batch_per_device(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                              "zero_optimization": {"stage": 2}}))
    job = derive_job(PLUGIN_FILE, [f"deepspeed_config.deepspeed_config_file={ds}"], workload=MODEL)
    assert job.batch_size == 6 and job.strategy == "grad_accumulation:micro_batches=3+zero2"


@pytest.mark.parametrize("overrides, expected", [
    (["deepspeed_config.offload_optimizer_device=nvme"],
     "deepspeed_config.offload_optimizer_device=nvme: NVMe offload is not predicted by membench; valid choices: "
     "none, cpu"),
    (["deepspeed_config.zero_stage=4"], "deepspeed_config.zero_stage: unknown value 4; valid choices: 0, 1, 2, 3"),
    (["deepspeed_config.zero_stages=3"], "deepspeed_config.zero_stages: not a key this configuration has"),
    (["deepspeed_config.deepspeed_config_file=ds.json"],
     "deepspeed_config.gradient_accumulation_steps: the deepspeed_config_file decides it and accelerate refuses both"),
    (["parallelism_config.parallelism_config_tp_size=2"], "with distributed_type DEEPSPEED: DeepSpeed's tensor and "
                                                          "sequence parallelism are not predicted"),
])
def test_a_bad_plugin_value_is_one_line_and_exit_2(tmp_path, capsys, overrides, expected):
    code = main(["predict", "--config", str(PLUGIN), *overrides, "--workload", "hf:tiny-llama", "--out",
                 str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("overrides, expected", [
    (["mixed_precision=bf16"], "mixed_precision='bf16' beside deepspeed_config.deepspeed_config_file: accelerate "
                               "refuses it"),
    (["deepspeed_config.deepspeed_config_file=missing.json"], "no DeepSpeed configuration file 'missing.json'"),
])
def test_what_accelerate_refuses_beside_a_config_file_is_refused(tmp_path, capsys, overrides, expected):
    code = main(["predict", "--config", str(PLUGIN_FILE), *overrides, "--workload", "hf:tiny-llama", "--out",
                 str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_predict_config_of_the_plugin_runs_zero3_on_its_ranks(tmp_path, capsys):
    """End to end at a tiny size on the CPU: the plugin's case predicted per rank (offload needs CUDA, so none)."""
    code = main(["predict", "--config", str(PLUGIN), "num_processes=2",
                 "deepspeed_config.offload_optimizer_device=none", "deepspeed_config.gradient_accumulation_steps=1",
                 "--workload", "hf:tiny-llama:seq_len=16",
                 "--device", "cpu", "--phases", "train", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("bf16_weights+zero3"))
    assert code == 0 and "unsupported" not in row and "largest rank of 2" in row, out


# --- axolotl's deepspeed and fsdp_config ----------------------------------------------------------------------------

def test_axolotls_deepspeed_is_the_trainers_zero3_with_autos_from_its_keys():
    job = derive_job(AXOLOTL, model="llama-3.1-8b")
    assert job.kind == "axolotl" and job.batch_size == 4 and job.ranks is None
    assert job.strategy == ("bf16_weights+checkpoint:segments=all+optimizer:impl=fused+grad_accumulation:"
                            f"micro_batches=4+zero3:{AUTO_SIZES}")
    fates = _fates(job)
    assert fates["deepspeed"] == fates["deepspeed.train_micro_batch_size_per_gpu"] == USED
    assert fates["deepspeed.gradient_clipping"] == NOT_MODELLED
    assert any("--ranks N" in line for line in job.assumptions)


def test_axolotl_opens_deepspeed_from_the_working_directory_or_takes_the_mapping(tmp_path, monkeypatch):
    values = load_file(AXOLOTL)
    zero2 = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}
    (tmp_path / "zero2.json").write_text(json.dumps(zero2))
    monkeypatch.chdir(tmp_path)
    from_cwd = derive_job({**values, "deepspeed": "zero2.json"}, model="llama-3.1-8b")
    inline = derive_job({**values, "deepspeed": zero2}, model="llama-3.1-8b")
    assert from_cwd.strategy == inline.strategy and "+zero2" in inline.strategy


@pytest.mark.parametrize("overrides, fsdp", [
    (["fsdp_version=2", "fsdp_config.offload_params=true", "fsdp_config.reshard_after_forward=false",
      "fsdp_config.transformer_layer_cls_to_wrap=LlamaDecoderLayer", "fsdp_config.state_dict_type=FULL_STATE_DICT"],
     "fsdp:reshard_after_forward=false:offload=cpu:param_dtype=bfloat16:reduce_dtype=bfloat16:output_dtype=bfloat16"),
    (["fsdp_version=2", "fsdp_config.fsdp_offload_params=true", "bf16=false"], "fsdp:offload=cpu"),  # older prefix
    (["fsdp=[full_shard, auto_wrap]", "fsdp_config.fsdp_transformer_layer_cls_to_wrap=LlamaDecoderLayer",
      "bf16=false"], "fsdp"),  # FSDP1 by default: predicted as FSDP2
])
def test_axolotls_fsdp_config_is_fsdp_with_accelerates_policy(overrides, fsdp):
    job = derive_job(AXOLOTL, ["~deepspeed", *overrides], model="llama-3.1-8b")
    members = job.strategy.split("+")
    assert spec_of([fsdp]) in members and not any(m.startswith("zero") for m in members)
    assert ("amp:dtype=bfloat16" in members) == ("bf16=false" not in overrides)
    _fates(job)


def test_an_axolotl_file_with_fsdp_config_is_axolotls_not_accelerates():
    values = {**load_file(AXOLOTL), "fsdp_config": {"offload_params": True}}
    assert kind_of_file(values) == "axolotl"


@pytest.mark.parametrize("overrides, expected", [
    (["fsdp_version=2", "fsdp_config.offload_params=true"], "axolotl keys deepspeed and fsdp/fsdp_config: axolotl "
                                                            "refuses both together"),
    (["~deepspeed", "fsdp=[hybrid_shard]"], "axolotl key fsdp: unknown word 'hybrid_shard'; valid choices"),
    (["~deepspeed", "fsdp_version=3", "fsdp_config.offload_params=true"], "fsdp_version: unknown value 3"),
    (["deepspeed=nowhere.json"], "no DeepSpeed configuration file 'nowhere.json'"),
])
def test_a_bad_axolotl_distributed_value_is_one_line_and_exit_2(tmp_path, capsys, overrides, expected):
    code = main(["predict", "--config", str(AXOLOTL), *overrides, "--workload", "hf:tiny-llama", "--out",
                 str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err

