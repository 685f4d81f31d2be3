"""The translation checked at small size: a prediction derived from TrainingArguments (config=, on the CPU,
exact) equals the transformers Trainer's own steps of the same configuration as membench's Trainer callback records
them, to the byte but for the Trainer loop's own bytes, named (tests/test_python_api.py's TRAINER_SCALARS)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import membench
from bench.jobs import derive_job

SEQ_LEN, BATCH = 8, 2
# the Trainer loop's own bytes at its second step's peak (tests/test_python_api.py says which): accelerate's
# DataLoaderShard holds the next batch (input_ids and labels, int64), and five 4-byte scalars
NEXT_BATCH_BYTES = 2 * BATCH * SEQ_LEN * 8
TRAINER_SCALAR_BYTES = 5 * 4


@pytest.fixture
def tiny_gpt2(tmp_path) -> Path:
    config = tmp_path / "tiny_gpt2.json"
    config.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 96, "n_embd": 32, "n_layer": 2, "n_head": 2,
                                  "n_positions": 64}))
    return config


def test_a_trainer_configuration_s_prediction_equals_the_trainer_s_step(tiny_gpt2, tmp_path, one_thread):
    from membench.hf import MembenchCallback
    from workloads import get_workload
    from workloads.hf import import_transformers

    transformers = import_transformers()
    args = transformers.TrainingArguments(str(tmp_path / "trainer"), max_steps=2, per_device_train_batch_size=BATCH,
                                          max_grad_norm=0.0, report_to=[], save_strategy="no",
                                          logging_strategy="no", use_cpu=True, disable_tqdm=True,
                                          dataloader_num_workers=0)
    job = derive_job(args, model=str(tiny_gpt2), max_length=SEQ_LEN)
    assert job.workload == f"hf:{tiny_gpt2}:seq_len={SEQ_LEN}:loss=model"
    assert job.strategy == "optimizer:impl=fused" and job.batch_size == BATCH  # the Trainer's default optim
    fates = {use.key: use.fate for use in job.keys}
    assert fates["max_grad_norm"] == "not modelled" and fates["logging_strategy"] == "ignored"

    workload = get_workload(job.workload)
    torch.manual_seed(workload.seed)
    model = workload.build_model()
    rows = workload.make_batch(BATCH, workload.data_sources[0])[0]["input_ids"].tolist()

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, index):
            return {"input_ids": rows[index % BATCH], "labels": rows[index % BATCH]}

    callback = MembenchCallback(tmp_path / "trainer_results", workload=job.workload)
    transformers.Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[callback]).train()
    estimate = membench.estimate(job.workload, strategies=job.strategy, batch_size=job.batch_size, device="cpu")
    assert estimate.status == "ok", estimate.message
    step = callback.steps[1]
    assert step.peak_bytes == estimate.allocated_bytes + NEXT_BATCH_BYTES + TRAINER_SCALAR_BYTES
