"""`membench.dry_run(trainer, ...)`: a constructed Hugging Face Trainer predicted from what it holds (its model's
config, its arguments, its peft settings, its data's longest batch), and the cheapest change of its arguments that
makes it fit."""

from __future__ import annotations

import pytest
import torch

import membench
from membench.dry_run import TrainerChange, change_tiers, trainer_changes
from workloads.framework.hf_presets import PRESETS

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = (5, 17, 9, 33, 12, 20)  # tokens + 1 of each example; the longest four make a 4 x 32 batch


def pad_collate(examples):
    """A collator as scripts write them: pads to the longest example, labels -100 on the padding."""
    longest = max(len(e["input_ids"]) for e in examples)
    ids = torch.tensor([e["input_ids"] + [0] * (longest - len(e["input_ids"])) for e in examples])
    labels = torch.tensor([e["input_ids"] + [-100] * (longest - len(e["input_ids"])) for e in examples])
    return {"input_ids": ids, "labels": labels}


def tiny_trainer(tmp_path, meta: bool = False, preset: str = "tiny-llama", lengths=LENGTHS, **arguments):
    from workloads.hf import import_transformers

    transformers = import_transformers()
    values = {k: v for k, v in PRESETS[preset].items() if k not in ("model_type", "architectures")}
    config = transformers.LlamaConfig(**values)
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = transformers.LlamaForCausalLM(config)
    if meta:
        model.hf_device_map = {"": "meta"}  # as from_pretrained(device_map="meta") marks it: the Trainer leaves it
    data = [{"input_ids": list(range(1, n))} for n in lengths]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), report_to=[], use_cpu=True,
                                          **{"per_device_train_batch_size": 4, **arguments})
    return transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=pad_collate)


def test_the_dry_run_predicts_the_trainers_longest_batch_as_predict_would(tmp_path):
    result = membench.dry_run(tiny_trainer(tmp_path), budget="1GiB")
    assert result.batch_shape == (4, 32)  # the four longest examples, padded by the Trainer's own collator
    assert result.fits and result.change is None and result.current["status"] == "ok"
    assert ":seq_len=32" in result.job.workload and ":loss=model" in result.job.workload
    assert result.job.batch_size == 4
    estimate = membench.estimate(result.job.workload, strategies=result.job.strategy, device="cpu",
                                 batch_size=result.job.batch_size, data="synthetic")
    assert result.current["predicted_peak_bytes"] == estimate.allocated_bytes  # the exact CPU count, the same step
    assert "fits" in str(result) and result.job.command() in str(result)


def test_a_step_that_does_not_fit_gets_the_cheapest_change_that_does(tmp_path):
    trainer = tiny_trainer(tmp_path)
    whole = membench.dry_run(trainer, budget="1GiB").current["judged_bytes"]
    result = membench.dry_run(trainer, budget=int(whole * 0.9))
    assert not result.fits and result.change is not None
    assert result.change_row["fits"] and result.change_row["judged_bytes"] < whole
    assert all(change.keeps_result for change in result.change)  # a like-for-like change was found first
    fitting = [row for combo, row in result.tried if row["fits"] and len(combo) == len(result.change)
               and all(c.keeps_result for c in combo)]
    assert result.change_row["est_step_time_ms"] == min(row["est_step_time_ms"] for row in fitting)
    assert result.change_text in str(result) and "cheapest change that fits" in str(result)


def test_nothing_fits_says_what_was_tried(tmp_path):
    trainer = tiny_trainer(tmp_path, per_device_train_batch_size=1, optim="adafactor")  # one lever left to pull
    result = membench.dry_run(trainer, budget=1024)
    assert not result.fits and result.change is None
    assert [[c.text for c in combo] for combo, _ in result.tried] == [["activation_checkpointing=True"]]
    assert "no change tried fits" in str(result)


def test_the_changes_are_the_trainers_own_levers():
    class Args:  # transformers before 5
        gradient_checkpointing, per_device_train_batch_size, gradient_accumulation_steps, optim = False, 4, 2, "adamw_torch"

    texts = [change.text for change in trainer_changes(Args())]
    assert texts == ["gradient_checkpointing=True",
                     "per_device_train_batch_size=2 with gradient_accumulation_steps=4",
                     "per_device_train_batch_size=1 with gradient_accumulation_steps=8", 'optim="adamw_8bit"']
    tiers = change_tiers(trainer_changes(Args()))
    assert [len(tier[0]) for tier in tiers] == [1, 2, 3]
    for tier in tiers:  # never two batch splits in one change
        assert all(sum("per_device_train_batch_size" in c.fields for c in combo) <= 1 for combo in tier)
    Args.gradient_checkpointing, Args.optim, Args.per_device_train_batch_size = True, "paged_adamw_8bit", 1
    assert trainer_changes(Args()) == []
    assert TrainerChange("x", {}, True).keeps_result


def test_checkpointing_is_suggested_under_the_name_the_installed_trainer_reads(tmp_path):
    """transformers 5's argument is activation_checkpointing (gradient_checkpointing its deprecated alias, which
    dataclasses.replace drops): the suggestion must reach the derived case as checkpointing."""
    from membench.dry_run import _job_at, longest_batch, trainer_objects

    trainer = tiny_trainer(tmp_path)
    (change,) = [c for c in trainer_changes(trainer.args) if "checkpointing" in c.text]
    objects = trainer_objects(trainer)
    shape, _ = longest_batch(trainer)
    assert "checkpoint:segments=all" in _job_at(objects, shape, change.fields).strategy
    assert "checkpoint" not in _job_at(objects, shape, {}).strategy


def test_a_trainer_without_data_or_target_is_one_input_error(tmp_path):
    trainer = tiny_trainer(tmp_path)
    with pytest.raises(membench.InputError, match="gpu= .* or budget="):
        membench.dry_run(trainer)
    trainer.train_dataset = None
    with pytest.raises(membench.InputError, match="no train_dataset"):
        membench.dry_run(trainer, budget="1GiB")


@pytest.mark.slow
def test_an_8b_trainer_on_the_meta_device_is_predicted_for_a_gpu(tmp_path):
    """Llama 3.1 8B built on the meta device (nothing allocated), bf16 autocast, batch 2 x 4 accumulated, its
    longest example 2,048 tokens, on an H100: the full fine-tune does not fit, and a change is found."""
    trainer = tiny_trainer(tmp_path, meta=True, preset="llama-3.1-8b", lengths=(1025, 2049, 900, 1500),
                           per_device_train_batch_size=2, gradient_accumulation_steps=4, bf16=True)
    result = membench.dry_run(trainer, gpu="H100 80GB")
    assert result.batch_shape == (2, 2048)
    assert not result.fits and result.current["judged_bytes"] > 80 * 2**30
