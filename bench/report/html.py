"""REPORT.html: one self-contained page of a run (no network at view time): the sortable results table, interactive
charts, and the memory timeline of each case with a snapshot, by category, with its predicted timeline overlaid.

The charting library is plotly.js, inlined from the installed `plotly` package's offline bundle
(`plotly.offline.get_plotlyjs()`; `pip install 'membench[report]'`); a Content-Security-Policy meta forbids every
source but the page's own inline script and style, so nothing is fetched when the page is opened. The page draws
everything from one JSON blob; each timeline writes the largest total it drew into its `data-drawn-peak-bytes`
attribute (next to the results row's `data-row-peak-bytes`), which the browser test reads back.

Like the rest of the report, this reads files only (results CSVs, `<run>.snapshots/*.pickle`, `predict-*.csv` with
their snapshots, and a plan CSV where one is in the folder) and never imports torch.

Limitations: a timeline is drawn from at most `MAX_POINTS` points per case (the smallest and largest of each stretch,
and always the peak), and a predicted timeline overlays a measured one on the same case (workload, strategy, phase,
batch size, device) only, on the fraction of the step's events (the two traces need not have the same events).
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from bench.core.atomic import write_text_atomic
from bench.core.errors import UsageError
from bench.core.snapshots import (CATEGORIES, SNAPSHOT_SUFFIX, category_timeline, read_snapshot,
                                         replay_peaks, snapshot_folder)
from bench.report.data import load_results, pitfall_strategies, row_flag, strategy_order

MAX_POINTS = 1500
PAGE_LIMIT_BYTES = 20 * 1024 * 1024
CASE_KEYS = ("workload", "strategy", "phase", "batch_size", "device")
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data: blob:; "
       "font-src data:; connect-src 'none'; worker-src blob:")
TABLE_COLUMNS = (  # (column, heading, kind)
    ("workload", "workload", "text"), ("strategy", "strategy", "text"), ("phase", "phase", "text"),
    ("batch_size", "batch", "int"), ("device", "device", "text"), ("status", "status", "text"),
    ("verified", "matches baseline", "text"), ("peak_mem_bytes", "peak bytes", "bytes"),
    ("mem_vs_baseline", "memory × baseline", "ratio"), ("step_time_ms_median", "step ms (median)", "ms"),
    ("step_time_ms_ci", "step ms 95% CI", "text"), ("time_vs_baseline", "time × baseline", "ratio"),
    ("message", "note", "text"),
)


def plotly_bundle() -> str:
    """plotly.js from the installed `plotly` package; a UsageError saying how to install it where it is missing."""
    try:
        from plotly.offline import get_plotlyjs
    except ImportError:
        raise UsageError("report --html needs plotly: pip install 'membench[report]' (or `pip install plotly`); "
                         "the PNG charts and REPORT.md need nothing more") from None
    return get_plotlyjs()


def _case_key(values: dict[str, Any]) -> tuple:
    return tuple(str(values.get(k)) if k != "batch_size" else str(int(values.get(k) or 0)) for k in CASE_KEYS)


def _number(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def _snapshots_in(folder: Path) -> list[dict[str, Any]]:
    """Every membench snapshot in `folder` (unreadable or foreign pickles are skipped)."""
    found = []
    for path in sorted(folder.glob(f"*{SNAPSHOT_SUFFIX}")) if folder.is_dir() else []:
        try:
            snapshot = read_snapshot(path)
        except Exception:  # noqa: BLE001 - a file that is not a snapshot is not drawn
            continue
        if isinstance(snapshot, dict) and isinstance(snapshot.get("membench"), dict):
            snapshot["membench"]["file"] = path.name
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
            "replayed_peak_bytes": allocated, "replayed_reserved_bytes": reserved}


def _row_json(row: pd.Series, pitfalls: set[str]) -> dict[str, Any]:
    low, high = _number(row.get("step_time_ms_ci95_low")), _number(row.get("step_time_ms_ci95_high"))
    verified = {True: "yes", False: "NO"}.get(row.get("matches_baseline"), "-")
    values = {column: row.get(column) for column, _, _ in TABLE_COLUMNS}
    values.update(verified=verified, step_time_ms_ci=f"[{low:.1f}, {high:.1f}]" if low and high else "-",
                  batch_size=int(row["batch_size"]) if _number(row.get("batch_size")) is not None else None,
                  flag=row_flag(row) or "", pitfall=row["strategy"] in pitfalls,
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


def report_data(csv_paths: list[Path]) -> dict[str, Any]:
    """Everything the page draws, as JSON-ready data: the rows, the charts' groups, the cases' timelines."""
    frame = pd.concat([load_results(Path(p)) for p in csv_paths], ignore_index=True)
    pitfalls = pitfall_strategies(frame)
    order = strategy_order(frame)
    rows = [_row_json(row, pitfalls) for _, row in frame.iterrows()]
    folders = list(dict.fromkeys(Path(p).parent for p in csv_paths))
    measured = [s for p in csv_paths for s in _snapshots_in(snapshot_folder(Path(p)))]
    predicted = [s for folder in folders for path in sorted(folder.glob("predict-*.csv"))
                 for s in _snapshots_in(snapshot_folder(path)) if s["membench"].get("kind") == "predicted"]
    points = max(200, min(MAX_POINTS, 2_000_000 // max(1, len(measured))))
    cases: dict[tuple, dict[str, Any]] = {}
    for snapshot in measured:
        about = snapshot["membench"]
        case = cases.setdefault(_case_key(about), {"case": {k: about.get(k) for k in CASE_KEYS},
                                                   "ranks": [], "predicted": None})
        case["ranks"].append(_timeline_json(snapshot, points))
    for snapshot in predicted:
        case = cases.get(_case_key(snapshot["membench"]))
        if case is not None and case["predicted"] is None:
            case["predicted"] = _timeline_json(snapshot, points)
    by_key = {_case_key(row): row for row in rows}
    timelines = []
    for key, case in cases.items():
        case["ranks"].sort(key=lambda t: -1 if t["rank"] is None else t["rank"])
        row = by_key.get(key)
        case["row_peak_bytes"] = row["peak_mem_bytes"] if row else None
        timelines.append(case)
    timelines.sort(key=lambda c: (c["case"]["workload"], c["case"]["phase"] != "train",
                                  order.index(c["case"]["strategy"]) if c["case"]["strategy"] in order else 99))
    return {"rows": rows, "order": order, "columns": [list(c) for c in TABLE_COLUMNS], "categories": list(CATEGORIES),
            "timelines": timelines, "plans": [p for folder in folders for p in _plan_json(folder)],
            "runs": sorted({str(r) for r in frame["run_id"]}), "sources": [Path(p).name for p in csv_paths]}


def render_html(data: dict[str, Any], plotly_js: str) -> str:
    """The page: the CSP, the styles, plotly.js, the data and the script that draws it."""
    blob = json.dumps(data, separators=(",", ":"), default=str).replace("</", "<\\/")
    title = "membench report: " + ", ".join(data["runs"])
    return (_PAGE.replace("$CSP", CSP).replace("$TITLE", html.escape(title))
            .replace("$PLOTLY", plotly_js.replace("</script", "<\\/script")).replace("$DATA", blob)
            .replace("$SCRIPT", _SCRIPT))


def build_html(csv_paths: list[Path], out_dir: Path) -> Path:
    """Writes REPORT.html into `out_dir` from the results CSVs (and the snapshots, predictions and plans beside
    them); returns its path. A UsageError where plotly is not installed; a ValueError for a page over 20 MB."""
    plotly_js = plotly_bundle()
    page = render_html(report_data([Path(p) for p in csv_paths]), plotly_js)
    if len(page.encode()) > PAGE_LIMIT_BYTES:
        raise ValueError(f"REPORT.html would be {len(page.encode()):,} bytes, over the {PAGE_LIMIT_BYTES:,} limit")
    path = Path(out_dir) / "REPORT.html"
    write_text_atomic(path, page)
    return path


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="$CSP">
<title>$TITLE</title>
<style>
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; } h3 { font-size: 1em; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 3px 6px; text-align: left; }
th { background: #f0f0f0; cursor: pointer; user-select: none; }
th.sorted-asc::after { content: " \\25B2"; } th.sorted-desc::after { content: " \\25BC"; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.bad td { background: #fde8e8; } tr.mismatch td { background: #fff4d6; }
.ranks { display: flex; flex-wrap: wrap; gap: 8px; } .ranks > div { flex: 1 1 420px; min-width: 380px; }
.chart { height: 380px; } .note { color: #666; font-size: 0.85em; }
</style>
<script>$PLOTLY</script>
</head>
<body>
<h1>$TITLE</h1>
<p class="note">Opened from disk: everything on this page is inside this file. Click a column heading to sort.
Memory snapshots (<code>*.pickle</code> beside the CSV) open at pytorch.org/memory_viz.</p>
<h2>Results</h2>
<div id="results"></div>
<h2>Pitfalls</h2>
<div id="pitfalls"></div>
<h2>Peak memory and step time</h2>
<div id="charts"></div>
<h2>Memory over the measured step</h2>
<div id="timelines"></div>
<div id="plans"></div>
<script type="application/json" id="report-data">$DATA</script>
<script>$SCRIPT</script>
</body>
</html>
"""

_SCRIPT = r"""
"use strict";
const DATA = JSON.parse(document.getElementById("report-data").textContent);
const MiB = 1024 * 1024;
const COLORS = {weights: "#4c72b0", gradients: "#dd8452", optimizer_state: "#55a868", activations: "#c44e52",
                temporaries: "#8172b3", batch: "#937860"};
function unit(largest) {  // [name, bytes] of the unit that shows `largest` best
  return largest >= 1024 * MiB ? ["GiB", 1024 * MiB] : largest >= MiB ? ["MiB", MiB] : ["KiB", 1024];
}
function inUnit(b) { const [name, size] = unit(b); return (b / size).toFixed(1) + " " + name; }
function fmtBytes(b) {
  return b == null ? "-" : inUnit(b) + " (" + Math.round(b).toLocaleString("en") + " B)";
}
function times(v) { return v == null ? "-" : v.toFixed(2) + "x"; }
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text != null) e.textContent = text;
  return e;
}
function cell(row, column, kind) {
  const v = row[column];
  if (v == null || v === "") return ["-", ""];
  if (kind === "bytes") return [inUnit(v), v];
  if (kind === "ratio") return [Number(v).toFixed(2) + "x", v];
  if (kind === "ms") return [Number(v).toFixed(1), v];
  return [String(v), String(v)];
}
function table(rows) {
  const t = el("table", {class: "results"});
  const head = el("tr");
  DATA.columns.forEach(([column, heading, kind], i) => {
    const th = el("th", {"data-kind": kind}, heading);
    th.addEventListener("click", () => sortBy(t, i, kind, th));
    head.appendChild(th);
  });
  t.appendChild(el("thead")).appendChild(head);
  const body = t.appendChild(el("tbody"));
  for (const row of rows) {
    const tr = el("tr", {class: row.status !== "ok" ? "bad" : (row.verified === "NO" ? "mismatch" : "")});
    for (const [column, , kind] of DATA.columns) {
      const [text, value] = cell(row, column, kind);
      const td = el("td", {"data-value": value, class: ["text"].includes(kind) ? "" : "num"}, text);
      if (column === "peak_mem_bytes" && row.peak_mem_bytes != null) td.title = fmtBytes(row.peak_mem_bytes);
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
  return t;
}
function sortBy(t, index, kind, th) {
  const body = t.tBodies[0];
  const asc = !th.classList.contains("sorted-asc");
  t.querySelectorAll("th").forEach(h => h.classList.remove("sorted-asc", "sorted-desc"));
  th.classList.add(asc ? "sorted-asc" : "sorted-desc");
  const numeric = kind !== "text";
  const rows = Array.from(body.rows);
  rows.sort((a, b) => {
    let x = a.cells[index].dataset.value, y = b.cells[index].dataset.value;
    if (numeric) { x = x === "" ? -Infinity : Number(x); y = y === "" ? -Infinity : Number(y); }
    return (x < y ? -1 : x > y ? 1 : 0) * (asc ? 1 : -1);
  });
  rows.forEach(r => body.appendChild(r));
}
function groups() {
  const out = new Map();
  for (const row of DATA.rows) {
    const key = [row.workload, row.device, row.batch_size, row.phase].join(" · ");
    if (!out.has(key)) out.set(key, []);
    out.get(key).push(row);
  }
  return out;
}
function barCharts() {
  const box = document.getElementById("charts");
  for (const [key, rows] of groups()) {
    const ok = rows.filter(r => r.status === "ok" && r.peak_mem_bytes != null);
    if (!ok.length) continue;
    box.appendChild(el("h3", {}, key));
    const wrap = box.appendChild(el("div", {class: "ranks"}));
    const mem = wrap.appendChild(el("div", {class: "chart"}));
    const time = wrap.appendChild(el("div", {class: "chart"}));
    const names = ok.map(r => r.strategy + (r.pitfall ? " (pitfall)" : ""));
    const [memUnit, memSize] = unit(Math.max(...ok.map(r => r.peak_mem_bytes)));
    Plotly.newPlot(mem, [{type: "bar", x: names, y: ok.map(r => r.peak_mem_bytes / memSize),
      customdata: ok.map(r => [fmtBytes(r.peak_mem_bytes), times(r.mem_vs_baseline), r.verified]),
      hovertemplate: "%{x}<br>peak %{customdata[0]}<br>%{customdata[1]} of the baseline<br>" +
                     "matches baseline: %{customdata[2]}<extra></extra>",
      marker: {color: ok.map(r => r.verified === "NO" ? "#e0a030" : "#4c72b0")}}],
      {title: {text: "peak memory (" + memUnit + ")"}, margin: {t: 40, b: 90}, yaxis: {title: {text: memUnit}}},
      {displayModeBar: false, responsive: true});
    const timed = ok.filter(r => r.step_time_ms_median != null);
    Plotly.newPlot(time, [{type: "bar", x: timed.map(r => r.strategy), y: timed.map(r => r.step_time_ms_median),
      error_y: {type: "data", symmetric: false,
                array: timed.map(r => r.step_time_ms_ci95_high == null ? 0
                                      : r.step_time_ms_ci95_high - r.step_time_ms_median),
                arrayminus: timed.map(r => r.step_time_ms_ci95_low == null ? 0
                                           : r.step_time_ms_median - r.step_time_ms_ci95_low)},
      customdata: timed.map(r => [r.step_time_ms_ci, times(r.time_vs_baseline)]),
      hovertemplate: "%{x}<br>median %{y:.1f} ms<br>95% CI %{customdata[0]} ms<br>" +
                     "%{customdata[1]} of the baseline<extra></extra>",
      marker: {color: "#55a868"}}],
      {title: {text: "step time (ms, median and 95% CI)"}, margin: {t: 40, b: 90}, yaxis: {title: {text: "ms"}}},
      {displayModeBar: false, responsive: true});
  }
}
function stageShapes(t) {
  const shapes = [], spans = [];
  let start = 0;
  for (let i = 1; i <= t.x.length; i++) {
    if (i === t.x.length || t.stage[i] !== t.stage[start]) {
      spans.push([t.stage[start], t.x[start], t.x[Math.min(i, t.x.length - 1)]]);
      start = i;
    }
  }
  const fill = {forward: "rgba(76,114,176,0.06)", backward: "rgba(221,132,82,0.08)",
                optimizer: "rgba(85,168,104,0.08)"};
  for (const [stage, x0, x1] of spans) {
    if (fill[stage]) shapes.push({type: "rect", xref: "x", yref: "paper", x0, x1, y0: 0, y1: 1, line: {width: 0},
                                  fillcolor: fill[stage], layer: "below"});
  }
  return shapes;
}
function timelineChart(target, t, predicted, title) {
  const [yUnit, ySize] = unit(t.peak.bytes);
  const traces = DATA.categories.map(c => ({type: "scatter", mode: "lines", stackgroup: "live", name: c, x: t.x,
    y: t.live[c].map(v => v / ySize), line: {width: 0.5, color: COLORS[c]},
    customdata: t.live[c].map((v, i) => [fmtBytes(v), t.stage[i]]),
    hovertemplate: c + ": %{customdata[0]}<br>stage %{customdata[1]}<extra></extra>"}));
  const total = t.x.map((_, i) => DATA.categories.reduce((s, c) => s + t.live[c][i], 0));
  const drawn = total.reduce((m, v) => Math.max(m, v), 0);
  target.setAttribute("data-drawn-peak-bytes", String(drawn));
  if (predicted) {
    const ptotal = predicted.x.map((_, i) => DATA.categories.reduce((s, c) => s + predicted.live[c][i], 0));
    traces.push({type: "scatter", mode: "lines", name: "predicted (" + (predicted.source || "") + ")", x: predicted.x,
      y: ptotal.map(v => v / ySize), line: {color: "#000", dash: "dot", width: 1.5},
      customdata: ptotal.map(v => fmtBytes(v)), hovertemplate: "predicted %{customdata}<extra></extra>"});
    target.setAttribute("data-predicted-peak-bytes", String(ptotal.reduce((m, v) => Math.max(m, v), 0)));
  }
  const p = t.peak;
  const where = [p.module || "(no module)", p.stage, p.op ? "aten::" + p.op : ""].filter(Boolean).join(" · ");
  const annotations = [{x: t.x[p.position], y: drawn / ySize, text: "peak " + inUnit(drawn) + "<br>" + where,
                        showarrow: true, arrowhead: 2, ax: 0, ay: -36, font: {size: 11}}];
  Plotly.newPlot(target, traces, {title: {text: title, font: {size: 13}}, margin: {t: 70, r: 10},
    xaxis: {title: {text: "fraction of the measured step's allocator events"}, range: [0, 1]},
    yaxis: {title: {text: "live " + yUnit}}, shapes: stageShapes(t), annotations, legend: {orientation: "h", y: -0.25},
    hovermode: "x unified"}, {displayModeBar: false, responsive: true});
}
function timelines() {
  const box = document.getElementById("timelines");
  if (!DATA.timelines.length) {
    box.appendChild(el("p", {class: "note"}, "No snapshots: run with --snapshot to draw these."));
    return;
  }
  for (const tl of DATA.timelines) {
    const c = tl.case;
    box.appendChild(el("h3", {}, [c.strategy, c.phase, "batch " + c.batch_size, c.workload, c.device].join(" · ")));
    const wrap = box.appendChild(el("div", {class: "ranks"}));
    // every rank's box first, so that each chart is drawn at its width beside the others
    const divs = tl.ranks.map(t => wrap.appendChild(el("div", {class: "chart timeline", "data-strategy": c.strategy,
      "data-phase": c.phase, "data-batch-size": String(c.batch_size), "data-workload": c.workload,
      "data-rank": t.rank == null ? "" : String(t.rank),
      "data-row-peak-bytes": tl.row_peak_bytes == null ? "" : String(tl.row_peak_bytes)})));
    tl.ranks.forEach((t, i) => {
      const title = (t.rank == null ? "" : "rank " + t.rank + ": ") + "peak " + fmtBytes(t.peak.bytes);
      timelineChart(divs[i], t, i === 0 ? tl.predicted : null, title);
    });
  }
}
function plans() {
  const box = document.getElementById("plans");
  for (const plan of DATA.plans) {
    box.appendChild(el("h2", {}, "Plan: " + plan.file));
    const div = box.appendChild(el("div", {class: "chart"}));
    Plotly.newPlot(div, [{type: "scatter", mode: "markers+text", x: plan.time,
      y: plan.peak.map(v => v == null ? null : v / MiB),
      text: plan.label, textposition: "top center",
      hovertemplate: "%{text}<br>%{x:.1f} ms<br>%{y:.1f} MiB<extra></extra>"}],
      {xaxis: {title: {text: plan.time_column}}, yaxis: {title: {text: plan.peak_column + " (MiB)"}}, margin: {t: 30}},
      {displayModeBar: false, responsive: true});
  }
}
const main = DATA.rows.filter(r => !r.pitfall), pitfalls = DATA.rows.filter(r => r.pitfall);
document.getElementById("results").appendChild(table(main));
if (pitfalls.length) document.getElementById("pitfalls").appendChild(table(pitfalls));
else document.getElementById("pitfalls").appendChild(el("p", {class: "note"}, "No pitfall in this run."));
barCharts();
timelines();
plans();
document.body.setAttribute("data-render-ms", String(Math.round(performance.now())));  // since navigation began
document.body.setAttribute("data-report-ready", "1");
"""
