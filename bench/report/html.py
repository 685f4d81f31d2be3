"""REPORT.html: one self-contained page of a run (no network at view time): the sortable results table, interactive
charts, and the memory timeline of each case with a snapshot, by category, with its predicted timeline overlaid.

The charting library is plotly.js, inlined from the installed `plotly` package's offline bundle
(`plotly.offline.get_plotlyjs()`; `pip install 'membench[report]'`); a Content-Security-Policy meta forbids every
source but the page's own inline script and style, so nothing is fetched when the page is opened. The page draws
everything from one JSON blob; each timeline writes the largest total it drew into its `data-drawn-peak-bytes`
attribute (next to the results row's `data-row-peak-bytes`), which the browser test reads back.

Like the rest of the report, this reads files only (results CSVs, `<run>.snapshots/*.pickle`, `predict-*.csv` with
their snapshots, and a plan CSV where one is in the folder) and never imports torch. A snapshot is read with the plain
types alone (`bench.core.snapshots.read_snapshot`): a file that names a class, or is not a regular file, is skipped
and named on the page and by the command. A `predict` CSV is a page of its own: its predictions as the table, and
each predicted snapshot drawn alone (allocated by category, and the modelled reserved bytes).

Limitations: a timeline is drawn from at most `MAX_POINTS` points per case (the smallest and largest of each stretch,
and always the peak), and a predicted timeline overlays a measured one on the same case (workload, strategy, phase,
batch size, device) only, on the fraction of the step's events (the two traces need not have the same events).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd

from bench.core.atomic import write_text_atomic
from bench.core.errors import UsageError
from bench.core.results import Status, read_results
from bench.core.snapshots import (CATEGORIES, SNAPSHOT_SUFFIX, category_timeline, largest_live, read_snapshot,
                                  replay_peaks, reserved_series, snapshot_folder)
from bench.report.data import format_size, load_results, pitfall_strategies, row_flag, strategy_order
from bench.report.html_page import render_html  # noqa: F401 - part of this module's API

MAX_POINTS = 1500
PAGE_LIMIT_BYTES = 20 * 1024 * 1024
CASE_KEYS = ("workload", "strategy", "phase", "batch_size", "device")
TABLE_COLUMNS = (  # (column, heading, kind)
    ("workload", "workload", "text"), ("strategy", "strategy", "text"), ("phase", "phase", "text"),
    ("batch_size", "batch", "int"), ("device", "device", "text"), ("status", "status", "text"),
    ("verified", "matches baseline", "text"), ("peak_mem_bytes", "peak bytes", "bytes"),
    ("mem_vs_baseline", "memory × baseline", "ratio"), ("step_time_ms_median", "step ms (median)", "ms"),
    ("step_time_ms_ci", "step ms 95% CI", "interval"), ("time_vs_baseline", "time × baseline", "ratio"),
    ("message", "note", "text"),
)
PITFALL_COLUMNS = (*TABLE_COLUMNS[:-1], ("mem_growth_bytes_per_step", "growth", "growth"), TABLE_COLUMNS[-1])
PREDICT_COLUMNS = (  # a predict CSV's table: its predicted bytes stand where a measured peak would
    ("workload", "workload", "text"), ("strategy", "strategy", "text"), ("phase", "phase", "text"),
    ("batch_size", "batch", "int"), ("device", "device", "text"), ("status", "status", "text"),
    ("peak_mem_bytes", "predicted bytes", "bytes"), ("predicted_reserved_bytes", "predicted reserved", "bytes"),
    ("engine", "engine", "text"), ("message", "note", "text"),
)
NOISE_THRESHOLD = 0.10  # bench.measure.stats's (not imported: the report reads files only); a test keeps them equal
PITFALL_NOTE = ("What each pitfall costs (growth = live bytes added per step); the baseline's eval leaves autograd "
                "on, fix: no_grad_eval.")
NOISY_NOTE = f"~ noisy: the 95% CI of the step time is wider than {NOISE_THRESHOLD:.0%} of the median"


def plotly_bundle() -> str:
    """plotly.js from the installed `plotly` package; a UsageError saying how to install it where it is missing."""
    try:
        from plotly.offline import get_plotlyjs
    except ImportError:
        raise UsageError("report --html needs plotly: pip install 'membench[report]' (or `pip install plotly`); "
                         "the PNG charts and REPORT.md need nothing more") from None
    return get_plotlyjs()


def _case_key(values: dict[str, Any]) -> tuple:
    number = _number(values.get("batch_size"))
    batch = str(int(number)) if number is not None and math.isfinite(number) else str(values.get("batch_size"))
    return tuple(str(values.get(k)) if k != "batch_size" else batch for k in CASE_KEYS)


def _number(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def _snapshots_in(folder: Path, skipped: list[str]) -> list[dict[str, Any]]:
    """Every membench snapshot in `folder`; a file that is refused (it names a class, it is a FIFO or a device) or
    unreadable is not drawn, and named in `skipped`; a snapshot without membench's "membench" dict is passed over."""
    found = []
    for path in sorted(folder.glob(f"*{SNAPSHOT_SUFFIX}")) if folder.is_dir() else []:
        try:
            snapshot = read_snapshot(path)
        except Exception as error:  # noqa: BLE001 - a file that is not a plain snapshot is not drawn, and said
            reason = str(error).replace(str(path), "").lstrip(": ") or type(error).__name__
            skipped.append(f"skipped {folder.name}/{path.name}: {reason}")
            continue
        if isinstance(snapshot, dict) and isinstance(snapshot.get("membench"), dict):
            snapshot["membench"]["file"] = path.name
            try:  # plain data, but maybe not a trace: drawn once here, so a malformed one is said, not a crash
                snapshot["membench"]["_drawn"] = _timeline_json(snapshot, MAX_POINTS)
            except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
                skipped.append(f"skipped {folder.name}/{path.name}: not a memory snapshot membench can draw "
                               f"({type(error).__name__}: {str(error)[:80]})")
                continue
            found.append(snapshot)
    return found


def _timeline_json(snapshot: dict[str, Any], points: int) -> dict[str, Any]:
    about = snapshot["membench"]
    timeline = category_timeline(snapshot, points)
    allocated, reserved = replay_peaks(snapshot)
    return {"file": about.get("file"), "rank": about.get("rank"), "kind": about.get("kind"),
            "source": about.get("source"), "events": timeline.events,
            "x": [round((i - timeline.first_event) / max(timeline.events - 1 - timeline.first_event, 1), 5)
                  for i in timeline.index], "stage": timeline.stage,
            "live": timeline.live, "peak": {"bytes": timeline.peak_bytes, "position": timeline.peak_position,
                                            "module": timeline.peak_module, "stage": timeline.peak_stage,
                                            "op": timeline.peak_op},
            "replayed_peak_bytes": allocated, "replayed_reserved_bytes": reserved,
            "reserved": reserved_series(snapshot, timeline.index) if reserved is not None else None,
            "largest": largest_live(snapshot, timeline.index[timeline.peak_position]) if timeline.index else []}


def _drawn(snapshot: dict[str, Any], points: int) -> dict[str, Any]:
    """The snapshot's timeline at `points` points (the one `_snapshots_in` drew where that is as many)."""
    return snapshot["membench"].pop("_drawn") if points >= MAX_POINTS else _timeline_json(snapshot, points)


def _row_json(row: pd.Series, pitfalls: set[str]) -> dict[str, Any]:
    low, high = _number(row.get("step_time_ms_ci95_low")), _number(row.get("step_time_ms_ci95_high"))
    verified = {True: "yes", False: "NO"}.get(row.get("matches_baseline"), "-")
    values = {column: row.get(column) for column, _, _ in TABLE_COLUMNS}
    values.update(verified=verified, step_time_ms_ci=f"[{low:.1f}, {high:.1f}]" if low and high else "-",
                  batch_size=int(row["batch_size"]) if _number(row.get("batch_size")) is not None else None,
                  flag=row_flag(row) or "", pitfall=row["strategy"] in pitfalls,
                  eval_baseline=row["strategy"] == "baseline" and row["phase"] == "eval",
                  noisy=row.get("noisy") is True and row["status"] == Status.OK,
                  mem_growth_bytes_per_step=_number(row.get("mem_growth_bytes_per_step")),
                  step_time_ms_ci95_low=low, step_time_ms_ci95_high=high)
    for column in ("peak_mem_bytes", "mem_vs_baseline", "step_time_ms_median", "time_vs_baseline"):
        values[column] = _number(values[column])
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in values.items()}


def _plan_json(folder: Path) -> list[dict[str, Any]]:
    """The points of each plan CSV in `folder` (`plan*.csv`, written by `bench plan`) that has a peak and a time
    column; a file in another format is skipped (the hook for plans: nothing else is assumed of them)."""
    plans = []
    for path in sorted(folder.glob("plan*.csv")):
        try:
            frame = pd.read_csv(path)
        except Exception:  # noqa: BLE001 - an unreadable plan file is not drawn
            continue
        peak = next((c for c in frame.columns if "peak" in c and c.endswith("_bytes")), None)
        time = next((c for c in frame.columns if "time" in c and c.endswith("_ms")), None)
        if peak is None or time is None:
            continue
        label = next((c for c in ("plan", "strategy", "recompute_plan") if c in frame.columns), None)
        plans.append({"file": path.name, "peak_column": peak, "time_column": time,
                      "peak": [_number(v) for v in frame[peak]], "time": [_number(v) for v in frame[time]],
                      "label": [str(v) for v in frame[label]] if label else [str(i) for i in range(len(frame))]})
    return plans


def is_predict_csv(path: Path) -> bool:
    """True for a `predict` table (its `predicted_bytes` column), which the page draws on its own."""
    try:
        columns = pd.read_csv(path, nrows=0).columns
    except Exception:  # noqa: BLE001 - an unreadable file is judged by the results reader, which says why
        return False
    # an anchors table has predicted_bytes too: the results reader names it in one line (OTHER_TABLES)
    return "predicted_bytes" in columns and "published_bytes" not in columns


def _predict_rows(path: Path) -> list[dict[str, Any]]:
    """A predict CSV's rows for the page's table: its predicted bytes where a measured peak would stand."""
    frame = read_results(path)
    rows = []
    for _, row in frame.iterrows():
        values = {c: (None if pd.isna(row.get(c)) else row.get(c)) for c, _, _ in PREDICT_COLUMNS if c in row}
        values.update(peak_mem_bytes=_number(row.get("predicted_bytes")), run_id=path.stem,
                      predicted_reserved_bytes=_number(row.get("predicted_reserved_bytes")),
                      batch_size=int(row["batch_size"]) if _number(row.get("batch_size")) is not None else None,
                      status=str(row.get("status") or Status.OK.value), pitfall=False, eval_baseline=False,
                      verified="-")
        rows.append(values)
    return rows


def verdicts(frame: pd.DataFrame, pitfalls: set[str]) -> list[str]:
    """One line per workload, device, batch size and phase: the matching technique (ok, equal to the baseline)
    with the smallest peak, and what it costs, or why there is none."""
    lines = []
    for key, rows in frame.groupby(["workload", "device", "batch_size", "phase"], sort=False, dropna=False):
        workload, device, batch, phase = key
        label = f"{workload} · {phase} · batch {int(batch) if _number(batch) is not None else batch} · {device}"
        ok = rows[(rows["status"] == Status.OK) & rows["peak_mem_bytes"].notna()]
        base = ok[ok["strategy"] == "baseline"]
        matching = ok[(ok["strategy"] != "baseline") & ~ok["strategy"].isin(pitfalls)
                      & ok["matches_baseline"].map(lambda v: v is True)]
        if matching.empty:
            lines.append(f"{label}: no technique ran and matched the baseline")
            continue
        best = matching.loc[matching["peak_mem_bytes"].idxmin()]
        mem, time = _number(best.get("mem_vs_baseline")), _number(best.get("time_vs_baseline"))
        cost = (f"{mem:.2f}× the baseline's memory" if mem is not None else "no baseline to compare with") + \
            (f" at {time:.2f}× its step time" if time is not None else "")
        saves = base.empty or best["peak_mem_bytes"] < base["peak_mem_bytes"].min()
        lines.append(f"{label}: " + ("the smallest matching technique is " if saves else
                                     "no technique saves memory; the smallest matching is ") +
                     f"{best['strategy']}, peak {format_size(best['peak_mem_bytes'])} ({cost})")
    return lines


def _timelines(measured: list[dict], predicted: list[dict], rows: list[dict], order: list[str],
               alone: bool) -> list[dict[str, Any]]:
    """The cases' timelines: each measured case's ranks with the prediction of the same case overlaid; with
    `alone`, every predicted snapshot is a case of its own (a predict CSV's page)."""
    points = max(200, min(MAX_POINTS, 2_000_000 // max(1, len(measured) + len(predicted))))
    cases: dict[tuple, dict[str, Any]] = {}
    for snapshot in measured + (predicted if alone else []):
        about = snapshot["membench"]
        case = cases.setdefault(_case_key(about), {"case": {k: about.get(k) for k in CASE_KEYS},
                                                   "ranks": [], "predicted": None})
        case["ranks"].append(_drawn(snapshot, points))
    for snapshot in [] if alone else predicted:
        case = cases.get(_case_key(snapshot["membench"]))
        if case is not None and case["predicted"] is None:
            case["predicted"] = _drawn(snapshot, points)
    by_key = {_case_key(row): row for row in rows}
    for key, case in cases.items():
        case["ranks"].sort(key=lambda t: -1 if not isinstance(t["rank"], int) else t["rank"])
        row = by_key.get(key)
        case["row_peak_bytes"] = row["peak_mem_bytes"] if row else None
    return sorted(cases.values(), key=lambda c: (str(c["case"]["workload"]), c["case"]["phase"] != "train",
                                                 order.index(c["case"]["strategy"])
                                                 if c["case"]["strategy"] in order else 99))


def report_data(csv_paths: list[Path]) -> dict[str, Any]:
    """Everything the page draws, as JSON-ready data: the rows, the verdicts, the charts' groups, the cases'
    timelines, and the snapshot files skipped (with why). Predict CSVs make a page of predictions."""
    csv_paths = [Path(p) for p in csv_paths]
    skipped: list[str] = []
    folders = list(dict.fromkeys(p.parent for p in csv_paths))
    if all(is_predict_csv(p) for p in csv_paths):
        rows = [r for p in csv_paths for r in _predict_rows(p)]
        order = list(dict.fromkeys(r["strategy"] for r in rows))
        predicted = [s for p in csv_paths for s in _snapshots_in(snapshot_folder(p), skipped)]
        return {"kind": "predict", "rows": rows, "order": order, "columns": [list(c) for c in PREDICT_COLUMNS],
                "pitfall_columns": [], "categories": list(CATEGORIES), "skipped": skipped,
                "verdicts": ["Predictions, not measurements: no verdict until `compare` measures them."],
                "pitfall_note": "", "noisy_note": "",
                "timelines": _timelines([], predicted, rows, order, alone=True), "plans": [],
                "runs": [p.stem for p in csv_paths], "sources": [p.name for p in csv_paths]}
    frame = pd.concat([load_results(p) for p in csv_paths], ignore_index=True)
    pitfalls = pitfall_strategies(frame)
    order = strategy_order(frame)
    rows = [_row_json(row, pitfalls) for _, row in frame.iterrows()]
    measured = [s for p in csv_paths for s in _snapshots_in(snapshot_folder(p), skipped)]
    predicted = [s for folder in folders for path in sorted(folder.glob("predict-*.csv"))
                 for s in _snapshots_in(snapshot_folder(path), skipped) if s["membench"].get("kind") == "predicted"]
    return {"kind": "results", "rows": rows, "order": order, "columns": [list(c) for c in TABLE_COLUMNS],
            "pitfall_columns": [list(c) for c in PITFALL_COLUMNS], "categories": list(CATEGORIES),
            "skipped": skipped, "verdicts": verdicts(frame, pitfalls), "pitfall_note": PITFALL_NOTE,
            "noisy_note": NOISY_NOTE if any(r["noisy"] for r in rows) else "",
            "timelines": _timelines(measured, predicted, rows, order, alone=False),
            "plans": [p for folder in folders for p in _plan_json(folder)],
            "runs": sorted({str(r) for r in frame["run_id"]}), "sources": [p.name for p in csv_paths]}


def build_html(csv_paths: list[Path], out_dir: Path, name: str = "REPORT.html") -> tuple[Path, list[str]]:
    """Writes the page `name` into `out_dir` from the results (or predict) CSVs and the snapshots, predictions and
    plans beside them; returns its path and the snapshot files skipped, with why. A UsageError where plotly is not
    installed, or for a page over PAGE_LIMIT_BYTES (nothing is written then)."""
    plotly_js = plotly_bundle()
    data = report_data([Path(p) for p in csv_paths])
    page = render_html(data, plotly_js)
    size = len(page.encode())
    if size > PAGE_LIMIT_BYTES:  # a browser slows to a crawl on such a page: one line, not a traceback
        raise UsageError(f"--html: {name} would be {size:,} bytes, over the page's limit of {PAGE_LIMIT_BYTES:,}; "
                         f"nothing was written: report fewer CSVs at once, or leave out --html (REPORT.md and the "
                         "charts have no such limit)")
    path = Path(out_dir) / name
    write_text_atomic(path, page)
    return path, data["skipped"]
