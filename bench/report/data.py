"""Results files read for the report and the charts: finding, loading and normalising CSVs, and grouping rows.

Like the report, this reads nothing but CSV files: no torch, runner, strategies or workloads. What it needs to know
of a strategy (a pitfall? a checkpointing plan, and what it recomputes?) the strategy declared into its rows
(`strategy_role`, `recompute_plan_kind`, `recompute_plan`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from bench.core.filenames import bounded_name
from bench.core.results import REPORT_COLUMNS, Role, Status, add_relative_columns, read_results_file
from bench.core.units import format_size, parse_size  # noqa: F401 - the report's and the charts' size helpers

DEFAULT_BATCH_SIZE = 100
# What one report draws, at most, so that its time is bounded whatever the CSVs hold (a 100,000-row file drew for
# minutes): the groups (a run's device, workload and data: a REPORT.md section and up to six charts each) and the
# batch sizes of a group's batch table and chart (spread from the smallest to the largest). What is left out is said.
MAX_GROUPS = 20
MAX_BATCH_SIZES = 12
MAX_STRATEGIES = 40  # of a group, in `strategy_order` (baseline, techniques, compositions, pitfalls)
STATUS_LABEL = {status.value: "OOM" if status is Status.OOM else status.value for status in Status}  # as shown
MISMATCH_LABEL = "≠ baseline"

def is_derived(path: Path) -> bool:
    """True for anything but a run's results file `<run_id>.csv` (run ids start with their UTC date): files
    derived from one (`<run_id>.timeline.csv`), `fit-*.csv` / `predict-*.csv` tables, temporary and hidden files."""
    name = path.name
    if not name.endswith(".csv") or not name[:1].isdigit():
        return True
    return "." in name[: -len(".csv")]


def newest_csv(results_dir: Path) -> Path:
    """The newest results file in `results_dir`: the latest-modified `*.csv` that is not derived from another
    (`<run_id>.timeline.csv` and the like) nor hidden; ties go to the later name (run ids sort by time)."""
    results_dir = Path(results_dir)
    candidates = [p for p in results_dir.glob("*.csv") if p.is_file() and not is_derived(p)]
    if not candidates:
        raise FileNotFoundError(f"no results CSV in {results_dir} (looked for *.csv other than *.timeline.csv)")
    return max(candidates, key=lambda p: (p.stat().st_mtime, p.name))


# --- loading ---------------------------------------------------------------------------------------------


def _to_bool(value):
    if isinstance(value, bool):
        return value
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    return None


NUMERIC = ["batch_size", "step_time_ms_median", "step_time_ms_iqr", "step_time_ms_min", "samples_per_s",
           "peak_mem_bytes", "peak_reserved_bytes", "mem_vs_baseline", "time_vs_baseline", "loss_rel_diff",
           "max_abs_grad_diff", "max_grad_rel_diff", "step_time_ms_ci95_low", "step_time_ms_ci95_high",
           "mem_growth_bytes_per_step", "max_param_rel_diff", "predicted_peak_bytes"]
TEXT = ["run_id", "workload", "strategy", "phase", "device", "device_name", "data", "status", "message",
        "torch_version", "cuda_version", "cpu_threads", "git_commit"]
# what the strategy declared of itself (schema 5): empty in an older file, whose rows are then neither pitfalls nor
# plans
ROLE = ["strategy_role", "recompute_plan", "recompute_plan_kind"]



def _text(column: pd.Series, missing: str = "") -> pd.Series:
    """A column as text, `missing` where it is empty; a column read as all-empty is float64, into which pandas will
    not fill a string: it is made an object column first."""
    return column.astype(object).fillna(missing).astype(str)

def load_results(csv_path: Path) -> pd.DataFrame:
    """One results CSV as a frame with the columns the report reads always present and normalised."""
    csv_path = Path(csv_path)
    frame = read_results_file(csv_path, "cannot report on", REPORT_COLUMNS)
    for column in TEXT + ROLE:
        if column not in frame:
            frame[column] = None
    for column in NUMERIC:
        if column in frame:
            frame[column] = pd.to_numeric(frame[column], errors="coerce")
        elif not column.startswith("step_time_ms_ci95"):
            frame[column] = float("nan")
    frame["run_id"] = _text(frame["run_id"], csv_path.stem)
    frame["status"] = _text(frame["status"], "error").str.strip().str.lower()
    # object columns of True, False and None: a column of booleans alone would become numpy.bool_, which
    # `is False` never is (a file whose every row was verified drew its mismatches as matches)
    frame["matches_baseline"] = pd.Series([_to_bool(v) for v in frame.get("matches_baseline", [None] * len(frame))],
                                          index=frame.index, dtype=object)
    if "noisy" in frame:
        frame["noisy"] = pd.Series([_to_bool(v) for v in frame["noisy"]], index=frame.index, dtype=object)
    for column in ("workload", "device", "device_name", "data", "phase", "strategy", "message", *ROLE):
        frame[column] = _text(frame[column])
    frame["_source"] = str(csv_path)
    # the values the run wrote are kept; the missing ones computed, from the baseline of the same run
    return add_relative_columns(frame, ["run_id", "workload", "phase", "device", "batch_size", "data"],
                                keep_present=True)


def find_timeline(csv_path: Path, run_id: str) -> Path | None:
    """`<stem>.timeline.csv` (or `<run_id>.timeline.csv`) next to the results file, if it exists."""
    csv_path = Path(csv_path)
    names = [f"{csv_path.stem}.timeline.csv"] + ([f"{run_id}.timeline.csv"] if safe_name(run_id) == run_id else [])
    for name in names:
        candidate = csv_path.with_name(name)
        if candidate.is_file():
            return candidate
    return None


# --- grouping --------------------------------------------------------------------------------------------


@dataclass
class Group:
    """The rows charted together: one run, one device, one workload, one data source."""

    run_id: str
    device: str
    workload: str
    data: str
    frame: pd.DataFrame
    suffix: str  # "" or ".cuda" etc. when a run holds several devices/workloads/data
    timeline: Path | None = None
    charts: dict[str, Path] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    strategies_left_out: int = 0  # past MAX_STRATEGIES: their rows are not in `frame`

    @property
    def stem(self) -> str:
        """The charts' file name stem: the run id as a plain file name (it comes from a CSV, where it may be
        `../x` or `/tmp/x`: nothing is ever written outside the report's folder) and the group's suffix."""
        return f"{safe_name(self.run_id)}{self.suffix}"

    def first(self, column: str, default: str = "?") -> str:
        values = self.frame[column].dropna().astype(str)
        values = values[values != ""]
        return values.iloc[0] if len(values) else default

    @property
    def batch_sizes(self) -> list[int]:
        return sorted(int(b) for b in self.frame["batch_size"].dropna().unique())

    @property
    def shown_batch_sizes(self) -> list[int]:
        """At most MAX_BATCH_SIZES of the batch sizes, spread evenly from the smallest to the largest, the charted
        batch among them: what the batch table and chart show."""
        sizes = self.batch_sizes
        if len(sizes) <= MAX_BATCH_SIZES:
            return sizes
        picked = {sizes[round(i * (len(sizes) - 1) / (MAX_BATCH_SIZES - 2))] for i in range(MAX_BATCH_SIZES - 1)}
        return sorted(picked | {self.chosen_batch})

    def batch_sizes_text(self) -> str:
        """The batch sizes shown, and how many are not (`, ... (12 of 3,125 batch sizes shown)`)."""
        shown, every = self.shown_batch_sizes, self.batch_sizes
        text = ", ".join(str(b) for b in shown)
        return text if len(shown) == len(every) else f"{text} ({len(shown)} of {len(every):,} batch sizes shown)"

    @property
    def chosen_batch(self) -> int | None:
        sizes = self.batch_sizes
        if not sizes:
            return None
        return DEFAULT_BATCH_SIZE if DEFAULT_BATCH_SIZE in sizes else max(sizes)

    def at_batch(self) -> pd.DataFrame:
        return self.frame[self.frame["batch_size"] == self.chosen_batch]

    def subtitle(self, batch: str | None = None) -> str:
        batch = batch or f"batch {self.chosen_batch}"
        return (f"{self.first('device_name', self.device)} ({self.device}) · {self.workload} · {batch} · "
                f"torch {self.first('torch_version')}")


def report_name(csv_paths: list[Path], extension: str) -> str:
    """The report's file name, after the run it reports: `<csv stem>.REPORT.md` (`.html`) for one CSV, the stems
    joined with `+` for several; so a run's report never overwrites another run's (at most 255 bytes)."""
    stem = "+".join(dict.fromkeys(Path(p).stem for p in csv_paths))
    return bounded_name(stem, f".REPORT{extension}")


def safe_name(text: str) -> str:
    """`text` as a plain file name: letters, digits, `_`, `+` and `-` kept, every other run of characters one `_`."""
    return re.sub(r"[^A-Za-z0-9_+-]+", "_", str(text)).strip("_") or "x"


def make_groups(frame: pd.DataFrame) -> list[Group]:
    groups = []
    for run_id, run in frame.groupby("run_id", sort=True):
        dims = ("device", "device_name", "workload", "data")  # a run over several kinds of GPU: one group each
        varying = [d for d in dims if run[d].nunique() > 1]
        if "device_name" in varying and run.groupby("device")["device_name"].nunique().max() == 1:
            varying.remove("device_name")  # one name per device: the device already tells the groups apart
        for key, rows in run.groupby(list(dims), sort=True):
            values = dict(zip(dims, key))
            suffix = "".join(f".{safe_name(values[d])}" for d in varying)
            rows = rows.drop_duplicates(["strategy", "phase", "batch_size"], keep="last")
            order = strategy_order(rows)
            kept = rows[rows["strategy"].isin(order[:MAX_STRATEGIES])] if len(order) > MAX_STRATEGIES else rows
            groups.append(Group(str(run_id), values["device"], values["workload"], values["data"], kept, suffix,
                                strategies_left_out=max(0, len(order) - MAX_STRATEGIES)))
    return groups


def pitfall_strategies(frame: pd.DataFrame) -> set[str]:
    """The strategies whose rows say they are pitfalls (`strategy_role`)."""
    return set(frame.loc[frame["strategy_role"] == Role.PITFALL.value, "strategy"])


def strategy_order(frame: pd.DataFrame, pitfalls: set[str] | None = None) -> list[str]:
    """Baseline first, then single techniques, then compositions, then pitfalls, each in the order they appear;
    `pitfalls` for a frame without `strategy_role` (a step timeline: its results file's `pitfall_strategies`)."""
    seen = list(dict.fromkeys(frame["strategy"]))
    pitfalls = pitfall_strategies(frame) if pitfalls is None else pitfalls
    rest = [s for s in seen if s != "baseline" and s not in pitfalls]
    return (["baseline"] if "baseline" in seen else []) + [s for s in rest if "+" not in s] + \
        [s for s in rest if "+" in s] + [s for s in seen if s in pitfalls]


def row_flag(row) -> str | None:
    """The status's label ('OOM', 'unsupported', ...) for rows without a measurement, '≠ baseline' for mismatches,
    else None."""
    if row["status"] != Status.OK:
        return STATUS_LABEL.get(row["status"], row["status"])
    if row["matches_baseline"] is False:
        return MISMATCH_LABEL
    return None




# --- checkpointing plans -----------------------------------------------------------------------------------

def is_checkpoint_plan(rows: pd.DataFrame) -> pd.Series:
    """Which rows are plans of what to recompute: the baseline (nothing) or one checkpointing strategy on its own,
    with any options, as the strategy declared (`recompute_plan_kind`)."""
    return rows["recompute_plan_kind"] != ""


def settings_of(row) -> dict[str, str]:
    """A row's `strategy_settings` (`name.option=value;...`) as a dict."""
    text = row.get("strategy_settings")
    if not isinstance(text, str):
        return {}
    return dict(part.split("=", 1) for part in text.split(";") if "=" in part)


def plan_label(row) -> str:
    """What a plan recomputes, for a chart label: the checkpointed units (`0-2 3-5`), a selective policy, or none
    (the strategy's `recompute_plan`)."""
    return row["recompute_plan"]


def plan_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """The ok training rows that are checkpointing plans, the baseline included, and that match the baseline."""
    mask = is_checkpoint_plan(rows) & (rows["phase"] == "train") & (rows["status"] == Status.OK)
    mask &= rows["matches_baseline"].map(lambda v: v is not False)
    return rows[mask & rows["peak_mem_bytes"].notna() & rows["step_time_ms_median"].notna()]


def state_floor_bytes(rows: pd.DataFrame) -> int | None:
    """Weights + gradients + optimizer state of the baseline training row (the floor no activation technique can
    go below; gradients as large as the weights), from its breakdown columns; None without them."""
    base = rows[(rows["strategy"] == "baseline") & (rows["phase"] == "train") & (rows["status"] == Status.OK)]
    if base.empty or not {"peak_params_bytes", "peak_optimizer_bytes"} <= set(base.columns):
        return None
    params = pd.to_numeric(base["peak_params_bytes"], errors="coerce").iloc[-1]
    optimizer = pd.to_numeric(base["peak_optimizer_bytes"], errors="coerce").iloc[-1]
    if pd.isna(params) or pd.isna(optimizer):
        return None
    return int(2 * params + optimizer)
