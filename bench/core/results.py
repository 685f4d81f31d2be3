"""The results table: its declared columns (units in their names), schema version, and atomic CSV writes."""

from __future__ import annotations

import secrets
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from bench.core import cell_checks
from bench.core.anchors_table import ANCHORS
from bench.core.check_tables import GPU_CHECK, PREDICTION_CHECK
from bench.core.atomic import write_text_atomic
from bench.core.text_enum import TextEnum
from bench.core.errors import UsageError
from bench.core.schema import Row, Table, columns

# 2: workload_settings, output_rel_diff; `workload` holds the workload spec (name and options)
# 3: max_param_rel_diff (the weights after one optimizer step), mem_growth_bytes_per_step; STRATEGY_COLUMNS
#    (predicted_peak_bytes of a budget plan, compile_time_ms, offload_host_peak_bytes); host_name, executor, ranks,
#    rank_peak_max_bytes, rank_peak_min_bytes
# 4: adaptive timing: measured_steps is the count actually timed; TIMING_COLUMNS (the options and why timing stopped);
#    cpu_capability, cpu_bf16_native, cpu_fp16_native, emulated_16bit
# 5: ROLE_COLUMNS: what the strategy declares of itself (strategy_role, recompute_plan, recompute_plan_kind), so
#    that the report groups rows without knowing any strategy by name
# 6: verify_batch_size (a 16-bit case the CPU emulates is verified at a small batch); memory_method
#    cpu_fake_live_tensor_bytes (its memory counted on fake tensors)
# 7: RESIDENT_COLUMNS: the process's peak resident memory over the case, the process at rest before it, and the
#    harness's share (bench.measure.resident)
# 8: peak_communication_bytes, the breakdown's column of the collectives' buffers (FSDP2's all-gather and
#    reduce-scatter buffers, DDP's gradient buckets); FSDP2's unsharded parameters in flight move from
#    peak_activations_bytes to peak_params_bytes
# 9: host_mmap_threshold_bytes, the C heap's mmap threshold the process pinned (bench.measure.resident), which moves
#    CPU step times; empty where glibc's own dynamic threshold was left
SCHEMA_VERSION = 9


class Status(TextEnum):
    """How a case ended: measured, out of memory, not applicable to the case, failed, or stopped at its time limit."""

    OK = "ok"
    OOM = "oom"
    UNSUPPORTED = "unsupported"
    ERROR = "error"
    TIMEOUT = "timeout"  # --case-timeout: the case's worker process was killed at the deadline


STATUSES = tuple(status.value for status in Status)


class Role(TextEnum):
    """What a row's strategy is (`strategy_role`): the baseline, a technique, or a pitfall (a habit the articles
    warn about, measured to show its cost; a composition with a pitfall member is a pitfall)."""

    BASELINE = "baseline"
    TECHNIQUE = "technique"
    PITFALL = "pitfall"


# The columns every results file has, in this order (RESULTS below); a test checks it.
_CORE = [
    *columns("int", "schema_version"), *columns("text", "run_id timestamp"),
    # the case
    *columns("text", "workload workload_settings strategy strategy_settings phase device device_name host_name"),
    *columns("int", "batch_size"), *columns("text", "data"), *columns("int", "warmup_steps measured_steps"),
    # timing pass
    *columns("float", "step_time_ms_median step_time_ms_iqr step_time_ms_min samples_per_s"),
    # memory pass
    *columns("int", "peak_mem_bytes peak_reserved_bytes"), *columns("text", "memory_method peak_stage"),
    *columns("float", "mem_growth_bytes_per_step"),
    # relative to the baseline row of the same workload, phase, batch size, device and data
    *columns("float", "mem_vs_baseline time_vs_baseline"),
    # verification against the baseline on the same weights and batch
    *columns("bool", "matches_baseline"), *columns("float", "loss_rel_diff max_abs_grad_diff max_grad_rel_diff"),
    *columns("int", "params_without_grad"), *columns("bool", "bn_stats_match"),
    *columns("float", "output_rel_diff max_param_rel_diff"), *columns("int", "verify_batch_size"),
    *columns("text", "status message"),
    # environment
    *columns("text", "torch_version cuda_version cudnn_version"), *columns("int", "cpu_threads"),
    *columns("text", "git_commit python_version platform"), *columns("int", "host_mmap_threshold_bytes"),
    # what the host CPU computes natively in 16 bits (bench.measure.cpu_16bit.cpu_16bit_support), and whether this
    # case ran 16-bit autocast emulated on a CPU without it
    *columns("text", "cpu_capability"), *columns("bool", "cpu_bf16_native cpu_fp16_native emulated_16bit"),
    # breakdown of the peak (CPU tracker only; they add up to peak_mem_bytes) and the article's rule of thumb
    *columns("int", "peak_params_bytes peak_grads_bytes peak_optimizer_bytes peak_activations_bytes peak_temp_bytes "
                    "peak_batch_bytes peak_communication_bytes rule_of_thumb_bytes"),
]

# Figures a strategy measures itself (`Strategy.columns()`; each strategy declares the ones it fills in its
# `row_columns`), empty for the others.
_STRATEGY = [*columns("int", "predicted_peak_bytes"), *columns("float", "compile_time_ms"),
                    *columns("int", "offload_host_peak_bytes")]

# How the timing pass chose its number of steps (bench.measure.timing.TimingPolicy): the options (empty where
# `timing_fixed_steps` fixed the count), why it stopped, the interval the rule looked at, and the pass's seconds.
_TIMING = [
    *columns("int", "timing_fixed_steps timing_min_steps"),
    *columns("float", "timing_max_time_s timing_target_ci_rel"), *columns("text", "timing_stop_reason"),
    *columns("float", "timing_ci_rel timing_pass_s"),
]

# Sweep columns (bench.run.isolation, bench.measure.stats), appended after the core ones: how the case was run and how
# far its figures can be trusted. `cpu_threads` above is the thread count the case ran with (--threads).
_SWEEP = [
    *columns("bool", "isolated"), *columns("text", "executor"),
    *columns("int", "ranks rank_peak_max_bytes rank_peak_min_bytes"), *columns("bool", "deterministic"),
    *columns("int", "repeats"), *columns("float", "step_time_ms_ci95_low step_time_ms_ci95_high"),
    *columns("bool", "noisy"), *columns("int", "peak_mem_spread_bytes"),
]

# What the strategy declares of itself (`Strategy.pitfall`, `recompute_plan_kind`, `recompute_plan()`), so that a
# reader of the CSV (the report) needs no registry: its Role, and for a checkpointing plan on its own (the baseline
# included) what it recomputes, for the plan chart's label, and the kind of plan (RECOMPUTE_PLAN_KINDS).
_ROLE = columns("text", "strategy_role recompute_plan recompute_plan_kind")
RECOMPUTE_PLAN_KINDS = ("none", "units", "operators")  # nothing recomputed; whole units; operators within units

# The process's own memory over the case (bench.measure.resident): its peak resident set, the process at rest before
# the case, the harness's share (peak - counted peak - rest), and how the peak was read.
_RESIDENT = [*columns("int", "process_peak_rss_bytes process_rest_rss_bytes harness_rss_bytes"),
             *columns("text", "process_rss_method")]

# the sweep columns stay last, as they have been since version 3
RESULTS = Table("results", SCHEMA_VERSION, _CORE + _STRATEGY + _TIMING + _ROLE + _RESIDENT + _SWEEP)
COLUMNS = RESULTS.names
STRATEGY_COLUMNS, TIMING_COLUMNS, ROLE_COLUMNS, RESIDENT_COLUMNS, SWEEP_COLUMNS = (
    [column.name for column in group] for group in (_STRATEGY, _TIMING, _ROLE, _RESIDENT, _SWEEP))


def new_row(values: dict | None = None, **more) -> Row:
    """A row of the results table: only its declared columns, `schema_version` set."""
    return RESULTS.row(values, **more)


# The other tables membench writes, each with its own schema version: a table's version says when *its* layout
# changed, so a predict file is not bumped by a column the results table gains (results/README.md, "Other files").
# Their columns keep the order the files had before they were declared; `schema_version` comes first, as in RESULTS.

# `python -m bench predict`: one row per case (bench.analysis.predict.predict_case)
# 1: the columns of the first undeclared files, and schema_version
# 2: the predicted peak by category (weights, gradients, optimizer state, activations, logits, other) and the
#    attention kernel of scaled_dot_product_attention (`sdpa_kernel`), after `ranks`
# 3: `recompute_plan`, what the step recomputed in backward (the checkpoint units of each checkpoint, a selective
#    policy, or `none`), and `offload_host_peak_bytes` (host memory of offloaded activations), after `sdpa_kernel`
# 4: `predicted_communication_bytes` (the collectives' buffers of a sharded strategy), after `offload_host_peak_bytes`
# 5: `workload_source`, the file the model's definition was read from (a Hub model's `org/name@commit: path`), last
# 6: `config`, the trainer configuration a case was derived from (`predict --config`: its kind, file and overrides), last
# 7: `cudnn_workspace_bytes` (cuDNN's convolution workspace at the predicted peak, from a table measured on a GPU)
#    in place of `cudnn_workspace_bound_bytes` (CUDNN_CONV_WSCAP_DBG's cap, which cuDNN's v8 API does not read)
PREDICT_SCHEMA_VERSION = 7
PREDICT = Table("predict", PREDICT_SCHEMA_VERSION, [
    *columns("int", "schema_version"),
    *columns("text", "workload strategy phase"), *columns("int", "batch_size"), *columns("text", "device"),
    *columns("int", "predicted_bytes"), *columns("float", "predicted_mib"),
    *columns("int", "predicted_reserved_bytes"), *columns("float", "predicted_reserved_mib"),
    *columns("int", "cublas_workspace_bytes cudnn_workspace_bytes"),
    *columns("text", "engine status message"), *columns("int", "ranks"),
    *columns("int", "predicted_weights_bytes predicted_grads_bytes predicted_optimizer_state_bytes "
                    "predicted_activations_bytes predicted_logits_bytes predicted_other_bytes"),
    *columns("text", "sdpa_kernel recompute_plan"), *columns("int", "offload_host_peak_bytes"),
    *columns("int", "predicted_communication_bytes"), *columns("text", "workload_source config"),
])

# `python -m bench fit`: one row per strategy (bench.analysis.fit.fit_rows, the fields of FitResult)
# 1: the columns of the first undeclared files, and schema_version
# 2: the axis searched (`over`: batch or seq_len) and the columns of the sequence-length search
# 3: `config`, the trainer configuration the strategy was derived from (`fit --config`), last
FIT_SCHEMA_VERSION = 3
FIT = Table("fit", FIT_SCHEMA_VERSION, [
    *columns("int", "schema_version"),
    *columns("text", "strategy phase device"), *columns("int", "budget_bytes batch_size peak_bytes"),
    *columns("bool", "verified"), *columns("int", "next_batch_peak_bytes"), *columns("text", "next_batch_method"),
    *columns("float", "time_per_sample_ms"), *columns("text", "note"), *columns("int", "runs"),
    *columns("text", "over"), *columns("int", "seq_len seq_len_step judged_bytes next_judged_bytes"),
    *columns("text", "peak_by monotonic_check config"),
])

# `python -m bench plan`: one row per candidate combination of techniques (bench.analysis.plan)
# 1: the first plan files
# 2: `config`, the trainer configuration the case was derived from (`plan --config`), last
# 3: `step_collective_bytes` and `est_comm_time_ms`, the step's collectives (est_step_time_ms now includes them);
#    step_moved_bytes no longer counts them
# 4: `offload_host_peak_bytes` (the host memory an offloading candidate holds, which the limit does not judge), after
#    `fits`
PLAN_SCHEMA_VERSION = 4
PLAN = Table("plan", PLAN_SCHEMA_VERSION, [
    *columns("int", "schema_version"),
    *columns("text", "workload"), *columns("int", "batch_size ranks"), *columns("text", "device target strategy"),
    *columns("int", "members"), *columns("text", "status message engine"),
    # memory: predicted, what the limit is compared with (reserved + CUDA context on CUDA, live bytes on the CPU)
    *columns("int", "predicted_peak_bytes predicted_reserved_bytes judged_bytes limit_bytes"), *columns("bool", "fits"),
    *columns("int", "offload_host_peak_bytes"),
    # time: the step's operators and the estimate from them (bench.analysis.plan_cost)
    *columns("int", "step_flops step_moved_bytes host_transfer_bytes step_collective_bytes step_ops"),
    *columns("float", "est_step_time_ms est_comm_time_ms"), *columns("text", "time_estimator"),
    # what is trained: why the candidate cannot give the baseline's result, and whether it may be the answer
    *columns("text", "differs_by_design"), *columns("bool", "eligible on_front answer"),
    # --confirm / --confirm-front: the harness's measurement (bench.run.runner) of the candidate
    *columns("int", "measured_peak_bytes"), *columns("float", "measured_step_time_ms peak_error_pct"),
    *columns("bool", "matches_baseline"), *columns("text", "config"),
])

# every table membench writes, by name (a test checks results/README.md documents each column and version)
TABLES = {table.name: table for table in (RESULTS, PREDICT, FIT, PLAN, PREDICTION_CHECK, ANCHORS, GPU_CHECK)}


CASE_KEY = ["workload", "strategy", "phase", "device", "batch_size", "data"]
BASELINE_KEY = ["workload", "phase", "device", "batch_size", "data"]
# relative column -> the column it divides by the baseline's
RELATIVE_COLUMNS = {"mem_vs_baseline": "peak_mem_bytes", "time_vs_baseline": "step_time_ms_median"}


def new_run_id(device: str = "") -> str:
    """A sortable, unique id: UTC time, the device, and a few random characters."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return "-".join(p for p in (stamp, device, secrets.token_hex(2)) if p)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def add_relative_columns(frame: pd.DataFrame, key: list[str] = BASELINE_KEY, keep_present: bool = False
                         ) -> pd.DataFrame:
    """`mem_vs_baseline` and `time_vs_baseline` of each ok row: its figure over that of the ok baseline row with
    the same `key` (the last one); empty on the other rows. `keep_present`: a value already in the frame is kept
    and only missing ones are computed (the report, reading what the run wrote)."""
    frame = frame.copy()
    ok = frame["status"] == Status.OK.value
    base = frame[(frame["strategy"] == "baseline") & ok]
    base = base.drop_duplicates(key, keep="last").set_index(key)
    for column, source in RELATIVE_COLUMNS.items():
        ref = frame.join(base[[source]].rename(columns={source: "_ref"}), on=key)["_ref"]
        computed = (pd.to_numeric(frame[source], errors="coerce") / pd.to_numeric(ref, errors="coerce")).where(ok)
        if keep_present:
            computed = frame[column].where(frame[column].notna(), computed).where(ok)
        frame[column] = computed
    return frame


def to_frame(rows: list[dict]) -> pd.DataFrame:
    """Rows -> a frame with exactly COLUMNS (the extra columns of a row read back from an older file are kept
    after them)."""
    frame = pd.DataFrame(rows)
    for column in COLUMNS:
        if column not in frame:
            frame[column] = None
    extra = [c for c in frame.columns if c not in COLUMNS]
    return add_relative_columns(frame[COLUMNS + extra])


def write_csv_atomic(frame: pd.DataFrame, path: Path, new: bool = False) -> None:
    """Writes to a temporary file in the same folder, then renames it over `path`: never a half-written CSV. A write
    that fails (a full disk) raises WriteFailed and leaves the previous file whole. With `new` (the first write of
    a run's file), `path` must not exist: a UsageError, and nothing overwritten, where it does."""
    try:
        write_text_atomic(path, frame.to_csv(index=False, lineterminator="\n"), new=new)
    except FileExistsError:
        raise UsageError(f"{str(path)!r} exists already: another run took the same run id (the same second and "
                         "random suffix); it was not overwritten: run again for a new id") from None


def write_rows(rows: list[dict], path: Path, new: bool = False) -> pd.DataFrame:
    """The rows as a results CSV at `path` (atomically), each whole-number column written as whole numbers
    (`7596999104`, not `7596999104.0`, also beside an empty cell or after a resume read it back as floats);
    returns the frame (as the rows hold it). `new`: the run's first write, never over an existing file."""
    frame = to_frame(rows)
    write_csv_atomic(_whole_numbers(frame), path, new)
    return frame


def _whole_numbers(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` with each declared int column whose values are all whole numbers as a nullable integer column."""
    frame = frame.copy()
    for column in RESULTS.names_of("int"):
        if column not in frame:
            continue
        numbers = pd.to_numeric(frame[column], errors="coerce")
        present = frame[column].notna()
        if numbers[present].notna().all() and (numbers[present] % 1 == 0).all():
            frame[column] = numbers.round().astype("Int64")
    return frame


def table_frame(table: Table, rows: list[dict]) -> pd.DataFrame:
    """Rows of `table` as a frame of its columns in order, `schema_version` set, each column of its declared kind:
    an int column stays whole numbers with empty cells (`1234`, not `1234.0`), a bool column `True`/`False`.
    Raises UndeclaredColumn for a key the table does not declare."""
    for row in rows:
        table.check(row)
    frame = pd.DataFrame(list(rows), columns=table.names)
    if "schema_version" in table.kinds:
        frame["schema_version"] = table.version
    for column in table.names_of("int"):
        frame[column] = frame[column].astype("Int64")
    for column in table.names_of("bool"):
        frame[column] = frame[column].astype("boolean")
    return frame


def write_table(table: Table, rows: list[dict], path: Path, new: bool = True) -> pd.DataFrame:
    """Rows of another declared table (predict, fit, the prediction check) as a CSV at `path`, atomically
    (`table_frame`: its columns in order, of their kinds); returns the frame written. `new` (the default: each
    table goes to a file of its own run id): never over an existing file; False to rewrite the file this run
    wrote before (a table written after each of its rows)."""
    frame = table_frame(table, rows)
    write_csv_atomic(frame, path, new)
    return frame


# the declared text columns, read as text: a value that looks like a number stays what it is (a commit such as
# `50685e286372` would be read as infinity, a device name `1080` as an integer)
TEXT_COLUMNS = RESULTS.names_of("text")


def read_results(path: Path) -> pd.DataFrame:
    """A results CSV back as a frame, text columns as text."""
    return pd.read_csv(path, dtype={column: str for column in TEXT_COLUMNS})

# Columns a results file must have to be reported on (what the report draws; the rest it recomputes or leaves out),
# and to be resumed (those, so that the rows written back keep their figures, and the whole case key). The other
# CSVs membench writes lack some of them.
REPORT_COLUMNS = ["strategy", "phase", "device", "batch_size", "status", "peak_mem_bytes"]
RESUME_COLUMNS = ["run_id", *REPORT_COLUMNS, *(c for c in CASE_KEY if c not in REPORT_COLUMNS)]
# a column that only one of the other tables has -> what that table is, for the error message
OTHER_TABLES = {"published_bytes": "an `anchors` table", "predicted_bytes": "a `predict` table",
                "budget_bytes": "a `fit` table", "judged_bytes": "a `plan` table",
                "live_bytes": "a step timeline (<run>.timeline.csv)"}
_SNIFF_BYTES = 1 << 16


def read_results_file(path: Path | str, purpose: str, required: list[str] = RESUME_COLUMNS) -> pd.DataFrame:
    """A results CSV handed to us by the user (`purpose`: "cannot resume", "cannot report on"), checked to be one
    with the `required` columns.

    Anything else -- a missing, empty or binary file, text that is not UTF-8, a file that is not CSV, another
    of membench's tables (fit, predict, timeline), a required column missing (renamed), or a cell whose value is not
    of its column's declared kind (text in `peak_mem_bytes`) -- is a UsageError of one line that says what the file
    is, or names the row and the column. `run --resume` and `report` both judge a file here, the same way."""
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
        unknown = [c for c in frame.columns if c not in RESULTS.kinds]
        renamed = f"; it has {unknown[0]!r}, which is not a results column: renamed?" if len(unknown) == 1 else ""
        raise UsageError(f"{where}: not a membench results file (no column {missing[0]!r}{renamed})")
    if frame.empty:
        raise UsageError(f"{where}: the file has a header but no rows")
    bad = cell_checks.first_bad_cell(pd.read_csv(path, dtype=str), RESULTS)
    if bad:
        row, column, value, why = bad
        raise UsageError(f"{where}: row {row} (line {row + 1}), column {column!r}: {value!r} {why}; fix or empty "
                         "the cell")
    return frame


def newer_schema_version(frame: pd.DataFrame, table: Table = RESULTS) -> int | None:
    """The schema version of a file's rows where it is newer than this membench writes of `table` (its rows mean
    what that newer membench says they mean), else None."""
    versions = pd.to_numeric(frame.get("schema_version", pd.Series(dtype=float)), errors="coerce").dropna()
    newest = versions.max() if len(versions) else None
    return int(newest) if newest is not None and newest > table.version and newest < float("inf") else None
