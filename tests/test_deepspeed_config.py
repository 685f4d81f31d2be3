"""DeepSpeed's configuration JSON read as membench's zero2/zero3 (bench/jobs/deepspeed.py): alone and under a
Trainer's `deepspeed` key, each key's fate, "auto" taken from the Trainer, bad values refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.core.errors import UsageError
from bench.jobs import derive_job
from bench.jobs.job import IGNORED, USED

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "configs" / "deepspeed"
ZERO3 = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
         "bf16": {"enabled": True},
         "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e7, "stage3_prefetch_bucket_size": 1e7,
                               "stage3_max_live_parameters": 2e8, "stage3_param_persistence_threshold": 1e4,
                               "offload_optimizer": {"device": "cpu", "pin_memory": True},
                               "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
         "steps_per_print": 100}


def _fates(job) -> dict[str, str]:
    return {use.key: use.fate for use in job.keys}


def test_a_zero3_json_alone_is_zero3_with_its_sizes_and_every_key_accounted_for():
    job = derive_job(ZERO3, model="hf:tiny-llama:seq_len=32")
    assert job.kind == "deepspeed" and job.batch_size == 2
    assert job.strategy == ("bf16_weights+zero3:reduce_bucket_size=50000000:offload_optimizer=cpu:"
                            "prefetch_bucket_size=10000000:max_live_parameters=200000000:"
                            "param_persistence_threshold=10000")
    fates = _fates(job)
    assert fates["zero_optimization.stage"] == USED and fates["bf16.enabled"] == USED
    assert fates["zero_optimization.offload_optimizer.pin_memory"] == IGNORED
    assert fates["zero_optimization.stage3_max_reuse_distance"] == USED
    assert fates["zero_optimization.stage3_gather_16bit_weights_on_model_save"] == IGNORED
    assert fates["steps_per_print"] == IGNORED
    assert len(job.keys) == 13  # every key of the file, none dropped


def test_zero2_reads_its_bucket_and_ignores_the_stage3_keys():
    values = {**ZERO3, "zero_optimization": {**ZERO3["zero_optimization"], "stage": 2, "overlap_comm": True}}
    job = derive_job(values, model="hf:tiny-llama:seq_len=32")
    assert job.strategy == "bf16_weights+zero2:reduce_bucket_size=50000000:overlap_comm=True:offload_optimizer=cpu"
    assert _fates(job)["zero_optimization.stage3_prefetch_bucket_size"] == IGNORED


def test_train_batch_size_gives_the_ranks_and_accumulation_is_grad_accumulation():
    values = {**ZERO3, "gradient_accumulation_steps": 2, "train_batch_size": 32}
    job = derive_job(values, model="hf:tiny-llama:seq_len=32")
    assert job.ranks == 8 and job.batch_size == 4 and "+grad_accumulation+" in job.strategy


def test_the_trainer_fills_auto_and_its_bf16_becomes_deepspeeds():
    job = derive_job(EXAMPLE / "sft_llama_8b_zero3.yaml")
    assert job.batch_size == 4 and "amp" not in job.strategy
    hidden = 4096  # llama-3.1-8b: transformers' auto rules (integrations/deepspeed.py)
    assert f"zero3:reduce_bucket_size={hidden * hidden}:prefetch_bucket_size={int(0.9 * hidden * hidden)}:" \
           f"param_persistence_threshold={10 * hidden}" in job.strategy  # 1e9: DeepSpeed's defaults, not spelt
    fates = _fates(job)
    assert fates["deepspeed.train_micro_batch_size_per_gpu"] == USED
    assert fates["deepspeed.zero_optimization.stage3_max_reuse_distance"] == USED
    assert "deepspeed" not in fates  # the key is read as its own keys


@pytest.mark.parametrize("change,message", [
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage: unknown value 4; valid choices: 0, 1, 2, 3"),
    ({"zero_optimization": {"stage": 3, "reduce_bucket_size": -1}}, "reduce_bucket_size: -1"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "nvme offload is not predicted"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_sise": 5}}, "not a key this configuration has"),
    ({"train_micro_batch_size_per_gpu": "auto"}, "'auto' is filled by the Trainer"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both true"),
    ({"train_batch_size": 7}, "train_batch_size: 7; valid: a multiple of"),
])
def test_bad_values_are_one_usage_error_naming_them(change, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        derive_job({**ZERO3, **change}, model="hf:tiny-llama:seq_len=32")


def test_the_command_line_refuses_a_bad_value_in_one_line_with_exit_2(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({**ZERO3, "zero_optimization": {"stage": 5}}))
    done = subprocess.run([sys.executable, "-m", "bench", "predict", "--config", str(config), "--workload",
                           "hf:tiny-llama:seq_len=32", "--ranks", "2"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "zero_optimization.stage" in done.stderr


def test_a_json_alone_takes_its_model_from_workload_without_calling_it_an_override(tmp_path):
    """A DeepSpeed JSON names no model: --workload is the job's model, not a value that overrides the file's."""
    config = tmp_path / "ds.json"
    zero2 = {**ZERO3, "zero_optimization": {"stage": 2, "reduce_bucket_size": 4096}}
    config.write_text(json.dumps(zero2))
    done = subprocess.run([sys.executable, "-m", "bench", "predict", "--config", str(config), "--workload",
                           "hf:tiny-llama:seq_len=16", "--ranks", "2", "--device", "cpu", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT)
    assert not [line for line in done.stdout.splitlines() if line.lstrip().startswith("--workload")], done.stdout
    assert "hf:tiny-llama:seq_len=16" in done.stdout and "zero2" in done.stdout, done.stdout + done.stderr[-2000:]
