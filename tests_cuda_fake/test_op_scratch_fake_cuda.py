"""What CUDA's operators hold while they run, on fake CUDA: the H200's measured figures predicted (cuDNN's
convolution workspaces, the reduction kernel's scratch), and plan tracing each candidate for the GPU it plans for."""

from __future__ import annotations

import csv
import glob
from pathlib import Path

import pandas as pd
import pytest

from bench.analysis import predict
from bench.cli.main import main
from bench.run.case import Case
from tests_cuda_fake.conftest import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

LEASE = Path(__file__).resolve().parent.parent / "results" / "reference" / "gpu" / "h200-20261130" / "lease1"


def measured_on_the_h200(anchor: str) -> int:
    [table] = glob.glob(str(LEASE / "check" / "gpu-check-*.csv"))
    with open(table, newline="") as handle:
        rows = {row["anchor"]: row for row in csv.DictReader(line for line in handle if not line.startswith("#"))}
    return int(rows[anchor]["measured_bytes"])


@pytest.mark.parametrize("workload, strategy, batch", [("unet", "baseline", 32), ("unet", "amp", 8)])
def test_unet_is_predicted_to_the_byte_the_h200_measured(workload, strategy, batch):
    row = predict.predict_case(Case(workload, strategy, "train", batch, "cuda", data="synthetic"), capability=(9, 0))
    assert row["engine"] == "fake-cuda" and row["cudnn_workspace_bytes"] > 0
    assert row["predicted_bytes"] == measured_on_the_h200(f"{workload} {strategy} train {batch}")


def test_a_16_bit_step_counts_the_reductions_scratch():
    # gpt_mini's bias gradients at batch 16 split across thread blocks: 4.2% below the H200's measurement without
    # their scratch, within 0.3% with it
    measured = measured_on_the_h200("gpt_mini amp:dtype=bfloat16 train 16")
    row = predict.predict_case(Case("gpt_mini", "amp:dtype=bfloat16", "train", 16, "cuda", data="synthetic"),
                               capability=(9, 0))
    assert abs(row["predicted_bytes"] - measured) / measured < 0.003


def test_plan_traces_each_candidate_for_the_gpu_it_plans_for(tmp_path):
    # an A100 (compute capability 8.0), not the fake device's 9.0: no convolution workspace from the H200's table,
    # the reductions' thread blocks for 108 multiprocessors, as predict has them for capability 8.0
    workload = "captcha_resnet18"
    assert main(["plan", "--workload", workload, "--batch-size", "16", "--gpu", "A100 80GB", "--strategies", "amp",
                 "--out", str(tmp_path)]) == 0
    planned = pd.read_csv(next(tmp_path.glob("plan-*.csv")), comment="#").set_index("strategy")
    on = {capability: predict.predict_case(Case(workload, "baseline", "train", 16, "cuda", data="synthetic"),
                                           capability=capability)["predicted_bytes"] for capability in ((8, 0), (9, 0))}
    assert on[(8, 0)] != on[(9, 0)]
    assert planned.loc["baseline", "predicted_peak_bytes"] == on[(8, 0)]
