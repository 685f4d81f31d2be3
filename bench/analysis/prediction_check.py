"""Predicted against measured CUDA memory: one row per case, and the CSV and markdown table a GPU run leaves in
results/cuda_prediction/ (the CSV a declared table, `bench.core.check_tables.PREDICTION_CHECK`).

The `cuda`-marked tests (tests/test_cuda_prediction.py) measure each case with `bench.run.runner.memory_pass` on the
GPU, predict it with `bench.analysis.predict.predict_case`, and hand both to `comparison_row`; at the end of the session
`write_comparison` writes `results/cuda_prediction/<run_id>.csv` and `.md`. Nothing here needs a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from bench.core.check_tables import PREDICTION_CHECK
from bench.core.results import new_run_id, now_iso, write_table
from bench.core.schema import Row
from bench.core.units import format_mib

# The largest relative error of predicted max_memory_allocated that the cuda tests accept.
TOLERANCE = 0.10

# the columns of the CSV, in order: declared once, in bench.core.check_tables.PREDICTION_CHECK
COMPARISON_COLUMNS = PREDICTION_CHECK.names


def relative_error_pct(predicted: int | None, measured: int | None) -> float | None:
    """(predicted - measured) / measured in percent; None when either is missing or measured is 0."""
    if predicted is None or not measured:
        return None
    return round(100.0 * (predicted - measured) / measured, 2)


def comparison_row(prediction: dict, measured: dict, env: dict) -> Row:
    """One row of the prediction-check table (`bench.core.check_tables.PREDICTION_CHECK`) from a `predict_case` row, a
    CUDA `memory_pass` result (`peak_mem_bytes`, `peak_reserved_bytes`) and the environment
    (`bench.measure.env.environment("cuda")`)."""
    error = relative_error_pct(prediction.get("predicted_bytes"), measured.get("peak_mem_bytes"))
    return PREDICTION_CHECK.row({
        "workload": prediction["workload"], "strategy": prediction["strategy"], "phase": prediction["phase"],
        "batch_size": prediction["batch_size"],
        "measured_bytes": measured.get("peak_mem_bytes"), "predicted_bytes": prediction.get("predicted_bytes"),
        "error_pct": error,
        "measured_reserved_bytes": measured.get("peak_reserved_bytes"),
        "predicted_reserved_bytes": prediction.get("predicted_reserved_bytes"),
        "reserved_error_pct": relative_error_pct(prediction.get("predicted_reserved_bytes"),
                                                 measured.get("peak_reserved_bytes")),
        "cublas_workspace_bytes": prediction.get("cublas_workspace_bytes"), "engine": prediction.get("engine"),
        "within_tolerance": error is not None and abs(error) <= 100 * TOLERANCE,
        "message": prediction.get("message", ""),
        "device_name": env.get("device_name"), "torch_version": env.get("torch_version"),
        "cuda_version": env.get("cuda_version"), "cudnn_version": env.get("cudnn_version"),
        "timestamp": now_iso(),
    })


def _mib(value) -> str:
    return "-" if value is None or pd.isna(value) else format_mib(value)


def _pct(value) -> str:
    return "-" if value is None or pd.isna(value) else f"{value:+.1f}%"


def markdown_table(rows: list[dict]) -> str:
    """The comparison as a markdown table, with the device and versions above it."""
    if not rows:
        return "No case was compared.\n"
    first = rows[0]
    lines = [f"# Predicted against measured CUDA memory", "",
             f"{first['device_name']}, torch {first['torch_version']}, CUDA {first['cuda_version']}, cuDNN "
             f"{first['cudnn_version']}. Measured: `torch.cuda.max_memory_allocated` / `max_memory_reserved` of one "
             f"steady-state step (`bench.run.runner.memory_pass`); predicted: `python -m bench predict` "
             f"(`bench.analysis.predict.predict_case`). Error = (predicted - measured) / measured; the tests fail "
             f"beyond {100 * TOLERANCE:.0f}% on allocated.", "",
             "| workload | strategy | phase | batch | measured MiB | predicted MiB | error | measured reserved MiB "
             "| predicted reserved MiB | reserved error | engine | within |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | `{r['strategy']}` | {r['phase']} | {r['batch_size']} | "
                     f"{_mib(r['measured_bytes'])} | {_mib(r['predicted_bytes'])} | {_pct(r['error_pct'])} | "
                     f"{_mib(r['measured_reserved_bytes'])} | {_mib(r['predicted_reserved_bytes'])} | "
                     f"{_pct(r['reserved_error_pct'])} | {r['engine'] or '-'} | "
                     f"{'yes' if r['within_tolerance'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def write_comparison(rows: list[dict], folder: Path, run_id: str | None = None) -> tuple[Path, Path] | None:
    """Writes `<run_id>.csv` and `<run_id>.md` into `folder` (each atomically); None when there is no row."""
    if not rows:
        return None
    run_id = run_id or new_run_id("cuda")
    folder = Path(folder)
    csv_path, md_path = folder / f"{run_id}.csv", folder / f"{run_id}.md"
    write_table(PREDICTION_CHECK, rows, csv_path)
    tmp = md_path.with_name(f".{md_path.name}.tmp")
    tmp.write_text(markdown_table(rows), encoding="utf-8")
    tmp.replace(md_path)
    return csv_path, md_path
