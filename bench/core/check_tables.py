"""The tables that set membench's CUDA predictions beside measurements on a GPU, declared beside the other tables
(`bench.core.results.TABLES`): the `cuda` tests' prediction check and tools/gpu/check.py's anchors on a GPU."""

from __future__ import annotations

from bench.core.schema import Table, columns

# The `cuda` tests' predicted-against-measured table (bench.analysis.prediction_check, results/cuda_prediction/).
# 5: its files carried the results table's version (5) with these columns until it had its own; it moves on its own
# from here. `schema_version` stays last, where those files had it.
PREDICTION_CHECK_SCHEMA_VERSION = 5
PREDICTION_CHECK = Table("prediction-check", PREDICTION_CHECK_SCHEMA_VERSION, [
    *columns("text", "workload strategy phase"), *columns("int", "batch_size measured_bytes predicted_bytes"),
    *columns("float", "error_pct"), *columns("int", "measured_reserved_bytes predicted_reserved_bytes"),
    *columns("float", "reserved_error_pct"), *columns("int", "cublas_workspace_bytes"), *columns("text", "engine"),
    *columns("bool", "within_tolerance"),
    *columns("text", "message device_name torch_version cuda_version cudnn_version timestamp"),
    *columns("int", "schema_version"),
])

# tools/gpu/check.py on a machine with a GPU: the prediction check's columns for each anchor's configuration (or a
# named case), measured there in a fresh process, with the row's status and timings
GPU_CHECK_SCHEMA_VERSION = 1
GPU_CHECK = Table("gpu-check", GPU_CHECK_SCHEMA_VERSION, [
    *columns("text", "anchor"), *[column for column in PREDICTION_CHECK.columns if column.name != "schema_version"],
    *columns("text", "status sdpa_kernel"), *columns("int", "measured_nvidia_smi_bytes"),
    *columns("float", "measure_s predict_s wall_s"), *columns("int", "schema_version"),
])
