"""Predicting a compiled step: under membench's dispatch modes torch.compile compiles for real
(`ignore_compile_internals`), and on fake tensors the compiled graphs run as they would on real ones. For
`compile:backend=aot_eager_decomp_partition` (inductor's partition on eager kernels) the prediction is the CPU's
measurement at the allocator; inductor itself is predicted as that partition, and its fusion only removes
temporaries: the prediction is at or above inductor's measurement, by little."""

from __future__ import annotations

import functools

import pytest

from bench.analysis.predict import predict_case
from bench.run.isolation import RunOptions
from bench.run.runner import Case, run_case
from strategies.compile import cpu_compiler

WORKLOAD = "gpt_mini:layers=2:width=64:heads=2:seq_len=32:dropout=0.0"  # no dropout: compiled masks differ
PARTITION = "compile:backend=aot_eager_decomp_partition"
# what the CPU allocator sees beyond the tracked tensors: kernels' own small buffers (12 B in this step)
KERNEL_BUFFERS_BYTES = 64


def _case(spec: str) -> Case:
    return Case(WORKLOAD, spec, "train", 4, "cpu", data="synthetic", warmup=1, steps=1)


@functools.lru_cache(maxsize=None)
def _measured(spec: str) -> dict:
    row = run_case(_case(spec), env={}, options=RunOptions(threads=1))
    assert row["status"] == "ok" and row["memory_method"] == "cpu_allocator_events", row["message"]
    return row


@pytest.mark.parametrize("spec", [PARTITION, f"{PARTITION}:scope=layers", f"{PARTITION}:scope=layers:loss=true"])
def test_the_partitions_prediction_is_its_measurement(spec):
    predicted = predict_case(_case(spec), engine="fake")
    assert predicted["status"] == "ok" and predicted["engine"] == "fake", predicted["message"]
    assert "fusion" not in predicted["message"]  # what it runs is what was predicted
    measured = _measured(spec)["peak_mem_bytes"]
    assert 0 <= measured - predicted["predicted_bytes"] <= KERNEL_BUFFERS_BYTES, (measured, predicted)


def test_the_partition_changes_the_peak_the_eager_step_has():
    eager = predict_case(_case("baseline"), engine="fake")["predicted_bytes"]
    compiled = predict_case(_case(PARTITION), engine="fake")["predicted_bytes"]
    assert compiled != eager  # compiled, not run eagerly under the tracker (what dynamo does under a dispatch mode)


@pytest.mark.slow
@pytest.mark.skipif(cpu_compiler() is None, reason="inductor on the CPU needs a C++ compiler")
def test_inductor_is_predicted_as_its_partition_at_or_above_its_measurement():
    predicted = predict_case(_case("compile"), engine="fake")
    assert predicted["status"] == "ok" and "fusion of a graph's temporaries is not modelled" in predicted["message"]
    assert predicted["predicted_bytes"] == predict_case(_case(PARTITION), engine="fake")["predicted_bytes"]
    measured = _measured("compile")["peak_mem_bytes"]
    assert measured <= predicted["predicted_bytes"] <= 1.05 * measured, (measured, predicted["predicted_bytes"])
