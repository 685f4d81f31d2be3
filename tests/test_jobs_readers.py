"""bench.jobs' readers on real configuration files: torchtune's shipped recipes, TRL/Trainer and axolotl files written
for the tests, Trainer objects; every key accounted for; bad keys and values refused in one line with exit code 2."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest

from bench.cli.main import main
from bench.core.errors import UsageError
from bench.jobs import derive_job
from bench.jobs.files import apply_overrides
from bench.jobs.job import workload_options
from strategies import parse_strategy

FIXTURES = Path(__file__).parent / "fixtures" / "jobs"


def _torchtune_config(name: str) -> Path:
    try:
        path = Path(importlib.metadata.distribution("torchtune").locate_file(f"recipes/configs/{name}"))
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("torchtune is not installed (make install installs it with --no-deps)")
    if not path.exists():
        pytest.skip(f"torchtune's package has no {name}")
    return path


def _members(job) -> set[str]:
    return set(parse_strategy(job.strategy).spec().split("+"))


def _accounted(job, path: Path | None = None):
    """Every key of the file is in the accounting once, with a fate and a reason."""
    assert all(use.fate in ("used", "ignored", "not modelled") and use.detail for use in job.keys)
    keys = [use.key for use in job.keys]
    assert len(keys) == len(set(keys))
    return set(keys)


def test_torchtune_s_llama3_1_8b_lora_recipe_field_by_field():
    path = _torchtune_config("llama3_1/8B_lora_single_device.yaml")
    job = derive_job(path, ["batch_size=4", "tokenizer.max_seq_len=4096", "enable_activation_offloading=True"])
    base, options = workload_options(job.workload)
    assert (base, options) == ("hf:llama-3.1-8b", {"seq_len": "4096"})
    assert job.batch_size == 4 * 8  # batch_size x gradient_accumulation_steps (8 in the file)
    assert _members(job) == set(parse_strategy(
        "bf16_weights+lora:r=8:alpha=16:targets=q_proj/v_proj/o_proj/gate_proj/up_proj/down_proj"
        "+checkpoint:segments=all+offload_activations+optimizer:impl=fused+chunked_loss"
        "+grad_accumulation:micro_batches=8").spec().split("+"))
    keys = _accounted(job)
    assert {"output_dir", "checkpointer.checkpoint_dir", "profiler.enabled", "optimizer.lr",
            "model.lora_rank", "dtype", "loss._component_"} <= keys
    fates = {use.key: use.fate for use in job.keys}
    assert fates["optimizer.lr"] == "ignored" and fates["model.lora_rank"] == "used"
    assert fates["loss._component_"] == "not modelled"  # CEWithChunkedOutputLoss's whole bf16 logits


def test_a_shipped_torchtune_configuration_by_its_tune_run_name():
    path = _torchtune_config("llama3_1/8B_lora_single_device.yaml")
    assert derive_job("llama3_1/8B_lora_single_device").workload == derive_job(path).workload
    with pytest.raises(UsageError, match="llama3_1/8B_nothing"):
        derive_job("llama3_1/8B_nothing")


def test_torchtune_qlora_and_component_overrides():
    path = _torchtune_config("llama3_1/8B_qlora_single_device.yaml")
    job = derive_job(path, ["optimizer=torchao.optim.AdamW8bit", "~optimizer.fused", "compile=True",
                            "tokenizer.max_seq_len=1024", "dataset.packed=True"])
    assert any(m.startswith("qlora") for m in _members(job))
    assert {"optimizer:name=adamw8bit", "compile:scope=layers:loss=True", "bf16_weights"} <= _members(job)
    assert workload_options(job.workload)[1] == {"seq_len": "1024", "packed": "4"}


def test_overrides_as_tune_run_takes_them():
    data = {"optimizer": {"_component_": "torch.optim.AdamW", "fused": True, "lr": 1e-4}, "batch_size": 2}
    result = apply_overrides(data, ["optimizer=bitsandbytes.optim.PagedAdamW8bit", "~optimizer.fused",
                                    "batch_size=8", "tokenizer.max_seq_len=512", "optimizer.lr=3e-4"])
    assert result == {"optimizer": {"_component_": "bitsandbytes.optim.PagedAdamW8bit", "lr": 3e-4},
                      "batch_size": 8, "tokenizer": {"max_seq_len": 512}}
    assert data["batch_size"] == 2  # the loaded file is not changed
    with pytest.raises(UsageError, match="no key 'nothing'"):
        apply_overrides(data, ["~nothing"])


def test_trl_sft_qlora_file_field_by_field():
    job = derive_job(FIXTURES / "trl_sft_qlora.yaml")
    assert job.kind == "trl"
    base, options = workload_options(job.workload)
    assert base == "hf:meta-llama/Llama-3.1-8B"
    assert options == {"seq_len": "4096", "task": "causal_lm", "packed": "16", "loss": "model"}
    assert job.batch_size == 16
    assert _members(job) == set(parse_strategy(
        "bf16_weights+qlora:r=32:alpha=64:dropout=0.05:targets=q_proj/k_proj/v_proj/o_proj+checkpoint:segments=all"
        "+optimizer:name=adamw8bit:impl=bitsandbytes:paged=true+amp:dtype=bfloat16"
        "+grad_accumulation:micro_batches=8").spec().split("+"))
    fates = {use.key: use.fate for use in job.keys}
    assert set(fates) == set(__import__("yaml").safe_load((FIXTURES / "trl_sft_qlora.yaml").read_text()))
    assert fates["attn_implementation"] == "not modelled" and fates["learning_rate"] == "ignored"
    assert any("bf16 not given" in line for line in job.assumptions)  # SFTConfig's default, True


def test_trainer_json_with_a_lora_section():
    job = derive_job(FIXTURES / "trainer_lora.json", model="llama-3.1-8b")
    assert job.kind == "trainer"
    assert workload_options(job.workload) == ("hf:llama-3.1-8b", {"seq_len": "2048", "loss": "model"})
    assert _members(job) == set(parse_strategy(
        "bf16_weights+lora:r=16:alpha=32:targets=q_proj/v_proj+checkpoint:segments=all+optimizer:impl=fused"
        "+amp:dtype=bfloat16+grad_accumulation:micro_batches=2").spec().split("+"))
    keys = _accounted(job)
    assert {"lora.r", "lora.task_type", "gradient_checkpointing_kwargs.use_reentrant", "output_dir"} <= keys


def test_axolotl_qlora_file_field_by_field():
    job = derive_job(FIXTURES / "axolotl_qlora.yaml")
    assert job.kind == "axolotl"
    assert workload_options(job.workload) == ("hf:meta-llama/Llama-3.1-8B",
                                              {"seq_len": "4096", "packed": "16", "loss": "model"})
    assert job.batch_size == 8
    assert _members(job) == set(parse_strategy(
        "bf16_weights+qlora:r=32:alpha=16:dropout=0.05:targets=all-linear+checkpoint:segments=all"
        "+optimizer:name=adamw8bit:impl=bitsandbytes+amp:dtype=bfloat16+grad_accumulation:micro_batches=4"
    ).spec().split("+"))
    fates = {use.key: use.fate for use in job.keys}
    assert fates["flash_attention"] == "not modelled" and fates["datasets"] == "ignored"
    assert fates["adapter"] == "not modelled"  # prepare_model_for_kbit_training's float32 casts, said


def test_the_trainer_s_objects_derive_the_same_case_as_its_file():
    from workloads.hf import import_transformers

    transformers = import_transformers()
    peft = pytest.importorskip("peft")
    args = transformers.TrainingArguments(output_dir="out", per_device_train_batch_size=4,
                                          gradient_accumulation_steps=2, bf16=True, gradient_checkpointing=True,
                                          gradient_checkpointing_kwargs={"use_reentrant": False},
                                          optim="adamw_torch_fused", learning_rate=1e-4, logging_steps=5, use_cpu=True)
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    config = transformers.LlamaConfig(**{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
                                         "max_position_embeddings": 4096, "dtype": "bfloat16"})
    job = derive_job(args, peft_config=lora, model_config=config)
    from_file = derive_job(FIXTURES / "trainer_lora.json", model="llama-3.1-8b")
    assert _members(job) == _members(from_file)
    assert job.batch_size == from_file.batch_size == 8
    assert Path(workload_options(job.workload)[0].removeprefix("hf:")).is_file()
    assert any(use.key == "use_cpu" and use.fate == "ignored" for use in job.keys)


@pytest.mark.parametrize("content, overrides, expected", [
    ({"model_name_or_path": "m/x", "optim": "adamw_wrong"}, [], "key optim: unknown value 'adamw_wrong'; valid"),
    ({"model_name_or_path": "m/x", "per_device_train_batch_size": "four"}, [], "per_device_train_batch_size: 'four' "
                                                                                "is not a int"),
    ({"model_name_or_path": "m/x", "lern_rate": 1e-4}, [], "key lern_rate: not a key"),
    ({"base_model": "m/x", "adapter": "qlora"}, [], "qlora needs load_in_4bit"),
    ({"model": {"_component_": "torchtune.models.llama3_1.lora_llama3_1_9b"}}, [], "unknown builder"),
    ({"model": {"_component_": "torchtune.models.llama3_1.llama3_1_8b"}, "dtype": "fp8"}, [],
     "key dtype: unknown value 'fp8'; valid choices: bf16, fp32"),
    ({"model": {"_component_": "torchtune.models.llama3_1.llama3_1_8b"}}, ["optimizer.fused"], "expected key=value"),
    ({"train_type": "qlora", "sharding_strategy": "zero3"}, [], "key sharding_strategy: unknown value 'zero3'"),
])
def test_a_bad_key_or_value_is_one_line_and_exit_2(tmp_path, capsys, content, overrides, expected):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    code = main(["predict", "--config", str(path), *overrides, "--device", "cpu", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert expected in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not list(tmp_path.glob("predict-*.csv"))  # refused before any prediction


def test_predict_config_prints_the_spec_and_predicts_it(tmp_path, capsys):
    code = main(["predict", "--config", str(FIXTURES / "trainer_lora.json"), "max_length=64", "dtype=float32",
                 "per_device_train_batch_size=1", "gradient_accumulation_steps=1", "bf16=false",
                 "--workload", "hf:tiny-llama", "--device", "cpu", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert ("--workload hf:tiny-llama:seq_len=64:loss=model --strategies lora:r=16:alpha=32:targets=q_proj/v_proj"
            "+checkpoint:segments=all+optimizer:impl=fused --batch-size 1") in out
    assert "--workload hf:tiny-llama overrides the configuration's model (meta-llama/Llama-3.1-8B)" in out
    assert "ignored" in out and "output_dir" in out
    rows = (next(tmp_path.glob("predict-*.csv"))).read_text().splitlines()
    assert len(rows) == 2 and "hf:tiny-llama:seq_len=64:loss=model" in rows[1]  # the derived case alone, recorded
    assert rows[1].endswith("trainer_lora.json max_length=64 dtype=float32 per_device_train_batch_size=1 "
                            "gradient_accumulation_steps=1 bf16=false")  # and the configuration it came from


def test_options_beside_the_configuration_win_and_say_so():
    job = derive_job(FIXTURES / "trainer_lora.json", model="llama-3.1-8b")
    changed, notes = job.with_explicit(workload="hf:tiny-llama:seq_len=32", batch_size=4)
    assert changed.workload == "hf:tiny-llama:seq_len=32:loss=model"  # the derived loss kept, the given length won
    assert changed.batch_size == 4 and changed.strategy == job.strategy
    assert [note.split(" overrides ")[0] for note in notes] == ["--workload hf:tiny-llama:seq_len=32", "--batch-size 4"]
    with pytest.raises(UsageError, match="accumulates 2 micro-batches"):
        job.with_explicit(batch_size=3)


def test_strategies_beside_a_configuration_are_refused(tmp_path, capsys):
    code = main(["predict", "--config", str(FIXTURES / "trainer_lora.json"), "--strategies", "amp", "--device", "cpu",
                 "--out", str(tmp_path)])
    assert code == 2 and "--strategies with --config" in capsys.readouterr().err


@pytest.mark.slow  # a plan and a fit on the CPU: about 18 s on 2 cores
def test_plan_and_fit_with_a_configuration_record_it(tmp_path, capsys):
    config = [str(FIXTURES / "trainer_lora.json"), "max_length=32", "dtype=float32", "bf16=false",
              "gradient_accumulation_steps=1"]
    assert main(["plan", "--config", *config, "--workload", "hf:tiny-llama", "--budget", "1GiB",
                 "--max-candidates", "1", "--jobs", "1", "--out", str(tmp_path / "plan")]) == 0
    assert main(["fit", "--config", *config, "--workload", "hf:tiny-llama", "--budget", "64MiB", "--max-batch", "4",
                 "--time-steps", "0", "--jobs", "1", "--out", str(tmp_path / "fit")]) == 0
    out = capsys.readouterr().out
    assert out.count("from trainer:") == 2  # each command printed the case it derived
    recorded = " ".join(config[1:])
    plan_rows = next((tmp_path / "plan").glob("plan-*.csv")).read_text().splitlines()
    assert plan_rows[0].endswith(",config") and plan_rows[1].endswith(recorded)
    assert "hf:tiny-llama:seq_len=32:loss=model" in plan_rows[1]
    fit_rows = next((tmp_path / "fit").glob("fit-*.csv")).read_text().splitlines()
    assert [row.endswith(recorded) for row in fit_rows[1:]] == [True, True]  # the baseline and the configuration's
    assert "lora:r=16:alpha=32:targets=q_proj/v_proj+checkpoint:segments=all+optimizer:impl=fused" in fit_rows[2]
