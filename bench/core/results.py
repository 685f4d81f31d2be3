"""The results table: its columns (units in their names), schema version, and atomic CSV writes."""

from __future__ import annotations

import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path
import secrets

import pandas as pd

# 2: workload_settings, output_rel_diff; `workload` holds the workload spec (name and options)
# 3: max_param_rel_diff (the weights after one optimizer step), mem_growth_bytes_per_step; STRATEGY_COLUMNS
#    (predicted_peak_bytes of a budget plan, compile_time_ms, offload_host_peak_bytes); host_name, executor, ranks,
#    rank_peak_max_bytes, rank_peak_min_bytes
# 4: adaptive timing: measured_steps is the count actually timed; TIMING_COLUMNS (the options and why timing stopped);
#    cpu_capability, cpu_bf16_native, cpu_fp16_native, emulated_16bit
SCHEMA_VERSION = 4
STATUSES = ("ok", "oom", "unsupported", "error")

# Every results file has these columns, in this order; a test checks it.
COLUMNS = [
    "schema_version", "run_id", "timestamp",
    # the case
    "workload", "workload_settings", "strategy", "strategy_settings", "phase", "device", "device_name", "host_name",
    "batch_size", "data",
    "warmup_steps", "measured_steps",
    # timing pass
    "step_time_ms_median", "step_time_ms_iqr", "step_time_ms_min", "samples_per_s",
    # memory pass
    "peak_mem_bytes", "peak_reserved_bytes", "memory_method", "peak_stage", "mem_growth_bytes_per_step",
    # relative to the baseline row of the same workload, phase, batch size, device and data
    "mem_vs_baseline", "time_vs_baseline",
    # verification against the baseline on the same weights and batch
    "matches_baseline", "loss_rel_diff", "max_abs_grad_diff", "max_grad_rel_diff", "params_without_grad",
    "bn_stats_match", "output_rel_diff", "max_param_rel_diff",
    "status", "message",
    # environment
    "torch_version", "cuda_version", "cudnn_version", "cpu_threads", "git_commit", "python_version", "platform",
    # what the host CPU computes natively in 16 bits (bench.measure.env.cpu_16bit_support), and whether this case ran
    # 16-bit autocast emulated on a CPU without it
    "cpu_capability", "cpu_bf16_native", "cpu_fp16_native", "emulated_16bit",
    # breakdown of the peak (CPU tracker only; they add up to peak_mem_bytes) and the article's rule of thumb
    "peak_params_bytes", "peak_grads_bytes", "peak_optimizer_bytes", "peak_activations_bytes", "peak_temp_bytes",
    "peak_batch_bytes", "rule_of_thumb_bytes",
]

# Figures a strategy measures itself (`Strategy.columns()`), empty for the others.
STRATEGY_COLUMNS = ["predicted_peak_bytes", "compile_time_ms", "offload_host_peak_bytes"]
COLUMNS += STRATEGY_COLUMNS

# How the timing pass chose its number of steps (bench.measure.timing.TimingPolicy): the options (empty where
# `timing_fixed_steps` fixed the count), why it stopped, the interval the rule looked at, and the pass's seconds.
TIMING_COLUMNS = [
    "timing_fixed_steps", "timing_min_steps", "timing_max_time_s", "timing_target_ci_rel", "timing_stop_reason",
    "timing_ci_rel", "timing_pass_s",
]
COLUMNS += TIMING_COLUMNS

# Sweep columns (bench.run.isolation, bench.measure.stats), appended after the core ones: how the case was run and how
# far its figures can be trusted. `cpu_threads` above is the thread count the case ran with (--threads).
SWEEP_COLUMNS = [
    "isolated", "executor", "ranks", "rank_peak_max_bytes", "rank_peak_min_bytes", "deterministic", "repeats",
    "step_time_ms_ci95_low", "step_time_ms_ci95_high", "noisy", "peak_mem_spread_bytes",
]
COLUMNS += SWEEP_COLUMNS

# A strategy whose name (or one of whose `+` members) starts with this is a pitfall: a habit the articles warn
# about, measured to show its cost. A naming rule, so that the report sees it in a CSV without the registry.
PITFALL_PREFIX = "pitfall_"


def is_pitfall(strategy: str) -> bool:
    """Whether a strategy spec (`pitfall_loss_sum`, `checkpoint+pitfall_retain_graph:...`) includes a pitfall."""
    return any(part.strip().startswith(PITFALL_PREFIX) for part in str(strategy).split("+"))


CASE_KEY = ["workload", "strategy", "phase", "device", "batch_size", "data"]
BASELINE_KEY = ["workload", "phase", "device", "batch_size", "data"]


def new_run_id(device: str = "") -> str:
    """A sortable, unique id: UTC time, the device, and a few random characters."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return "-".join(p for p in (stamp, device, secrets.token_hex(2)) if p)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def add_relative_columns(frame: pd.DataFrame) -> pd.DataFrame:
    """Fills `mem_vs_baseline` and `time_vs_baseline` from the ok baseline row with the same key."""
    frame = frame.copy()
    base = frame[(frame["strategy"] == "baseline") & (frame["status"] == "ok")]
    base = base.drop_duplicates(BASELINE_KEY, keep="last").set_index(BASELINE_KEY)
    for column, source in (("mem_vs_baseline", "peak_mem_bytes"), ("time_vs_baseline", "step_time_ms_median")):
        ref = frame.join(base[[source]].rename(columns={source: "_ref"}), on=BASELINE_KEY)["_ref"]
        values = pd.to_numeric(frame[source], errors="coerce") / pd.to_numeric(ref, errors="coerce")
        frame[column] = values.where(frame["status"] == "ok")
    return frame


def to_frame(rows: list[dict]) -> pd.DataFrame:
    """Rows -> a frame with exactly COLUMNS (extra keys are kept after them)."""
    frame = pd.DataFrame(rows)
    for column in COLUMNS:
        if column not in frame:
            frame[column] = None
    extra = [c for c in frame.columns if c not in COLUMNS]
    return add_relative_columns(frame[COLUMNS + extra])


def write_csv_atomic(frame: pd.DataFrame, path: Path) -> None:
    """Writes to a temporary file in the same folder, then renames it over `path`: never a half-written CSV."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private; a results file is as readable as any other
    try:
        with os.fdopen(fd, "w", newline="") as f:
            frame.to_csv(f, index=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_rows(rows: list[dict], path: Path) -> pd.DataFrame:
    """The rows as a results CSV at `path` (atomically); returns the frame written."""
    frame = to_frame(rows)
    write_csv_atomic(frame, path)
    return frame


# columns whose values look like numbers but are text: a commit such as `50685e286372` would be read as infinity
TEXT_COLUMNS = ["run_id", "git_commit", "host_name", "workload", "workload_settings", "strategy", "strategy_settings",
                "torch_version", "cuda_version", "cudnn_version", "python_version"]


def read_results(path: Path) -> pd.DataFrame:
    """A results CSV back as a frame, text columns as text."""
    return pd.read_csv(path, dtype={column: str for column in TEXT_COLUMNS})


# Columns a results file must have to be resumed (the case key), and to be reported on (what the report draws;
# the rest it recomputes or leaves out). The other CSVs membench writes lack some of them.
RESUME_COLUMNS = ["run_id", "status", *CASE_KEY]
REPORT_COLUMNS = ["strategy", "phase", "device", "batch_size", "status", "peak_mem_bytes"]
# a column that only one of the other tables has -> what that table is, for the error message
OTHER_TABLES = {"predicted_bytes": "a `predict` table", "budget_bytes": "a `fit` table",
                "live_bytes": "a step timeline (<run>.timeline.csv)"}
_SNIFF_BYTES = 1 << 16


def read_results_file(path: Path | str, purpose: str, required: list[str] = RESUME_COLUMNS) -> pd.DataFrame:
    """A results CSV handed to us by the user (`purpose`: "cannot resume", "cannot report on"), checked to be one
    with the `required` columns.

    Anything else -- a missing, empty or binary file, text that is not UTF-8, a file that is not CSV, or another
    of membench's tables (fit, predict, timeline) -- is a UsageError of one line that says what the file is."""
    from bench.core.errors import UsageError

    path = Path(path)
    where = f"{purpose} {str(path)!r}"
    if not path.is_file():
        raise UsageError(f"{where}: no such results file")
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
        if not head.strip():
            raise UsageError(f"{where}: the file is empty; give a results CSV written by `run` or `compare`")
        if b"\0" in head:
            raise UsageError(f"{where}: a binary file, not a results CSV")
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise UsageError(f"{where}: not UTF-8 text (byte 0x{error.object[error.start]:02x} at offset "
                         f"{error.start}); results CSVs are UTF-8") from None
    except OSError as error:
        raise UsageError(f"{where}: {error.strerror}") from None
    try:
        frame = read_results(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, ValueError) as error:
        raise UsageError(f"{where}: not a readable CSV ({str(error).splitlines()[0]})") from None
    for column, kind in OTHER_TABLES.items():
        if column in frame.columns:
            raise UsageError(f"{where}: this is {kind}, not a results file of `run` or `compare`")
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise UsageError(f"{where}: not a membench results file (no column {missing[0]!r})")
    if frame.empty:
        raise UsageError(f"{where}: the file has a header but no rows")
    return frame
