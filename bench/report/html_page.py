"""REPORT.html's page: the template, the script that draws it from one JSON blob, and the filling of both, escaped
for each context they land in.

Every value from a results folder (a CSV cell, a snapshot's module name, a file name) is hostile until escaped:
the template's placeholders are filled in one pass (a value that holds a placeholder's name is text, never filled
again); the title is escaped as HTML text; the data is JSON inside `<script type="application/json">` with `<`, `>`,
`&`, U+2028 and U+2029 written as `\\uXXXX` (no `</script>`, no `<!--` can end or derail that element); the script
builds the page with `textContent` and `setAttribute` only. The Content-Security-Policy allows the page's two scripts
by their SHA-256 hashes and nothing else: no inline event handler (`onerror=`), no other script, no request.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import re
from typing import Any

PLACEHOLDER = re.compile(r"\$(CSP|TITLE|PLOTLY|DATA|SCRIPT)\b")
JSON_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def csp(*scripts: str) -> str:
    """The page's Content-Security-Policy: the inline scripts `scripts` (their exact text) by hash, styles inline,
    images from data: and blob: (plotly's), and nothing from anywhere else."""
    hashes = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'" for s in scripts)
    return (f"default-src 'none'; script-src {hashes or chr(39) + 'none' + chr(39)}; style-src 'unsafe-inline'; "
            "img-src data: blob:; font-src data:; connect-src 'none'; worker-src blob:; base-uri 'none'; "
            "form-action 'none'")


def json_for_script(data: Any) -> str:
    """`data` as JSON that can sit inside a <script> element: ASCII, with the characters HTML or JavaScript would
    read as markup or a line end written as \\u escapes."""
    text = json.dumps(_finite(data), separators=(",", ":"), default=str, allow_nan=False, ensure_ascii=True)
    return re.sub(r"[<>&\u2028\u2029]", lambda m: JSON_ESCAPES[m.group()], text)


def _finite(value: Any) -> Any:
    """`value` with NaN and the infinities as None (JSON has none of them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def render_html(data: dict[str, Any], plotly_js: str) -> str:
    """The page: the CSP, the styles, plotly.js, the data and the script that draws it, filled in one pass."""
    plotly = plotly_js.replace("</script", "<\\/script")
    values = {"TITLE": html.escape("membench report: " + ", ".join(map(str, data["runs"])), quote=True),
              "PLOTLY": plotly, "DATA": json_for_script(data), "SCRIPT": SCRIPT}
    values["CSP"] = html.escape(csp(plotly, SCRIPT), quote=False).replace('"', "&quot;")  # in a "-quoted value
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], PAGE)


PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="$CSP">
<title>$TITLE</title>
<style>
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; overflow-wrap: anywhere; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; } h3 { font-size: 1em; }
.scroll { overflow-x: auto; max-width: 100%; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 3px 6px; text-align: left; overflow-wrap: normal; }
th { background: #f0f0f0; cursor: pointer; user-select: none; }
th.sorted-asc::after { content: " \\25B2"; } th.sorted-desc::after { content: " \\25BC"; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.bad td { background: #fde8e8; } tr.mismatch td { background: #fff4d6; }
.ranks { display: flex; flex-wrap: wrap; gap: 8px; } .ranks > div { flex: 1 1 360px; min-width: 0; }
.chart { height: 380px; width: 100%; } .note { color: #666; font-size: 0.85em; }
@media (max-width: 600px) { body { margin: 0.5em; } .chart { height: 320px; } }
</style>
<script>$PLOTLY</script>
</head>
<body>
<h1>$TITLE</h1>
<p class="note">Opened from disk: everything on this page is inside this file. Click a column heading to sort.
Memory snapshots (<code>*.pickle</code> beside the CSV) open at pytorch.org/memory_viz.</p>
<div id="skipped"></div>
<h2>Verdict</h2>
<div id="verdicts"></div>
<h2>Results</h2>
<div id="results"></div>
<h2>Pitfalls</h2>
<div id="pitfalls"></div>
<h2>Peak memory and step time</h2>
<div id="charts"></div>
<h2>Memory over the step</h2>
<div id="timelines"></div>
<div id="plans"></div>
<script type="application/json" id="report-data">$DATA</script>
<script>$SCRIPT</script>
</body>
</html>
"""

SCRIPT = r"""
"use strict";
const DATA = JSON.parse(document.getElementById("report-data").textContent);
const MiB = 1024 * 1024;
const COLORS = {weights: "#4c72b0", gradients: "#dd8452", optimizer_state: "#55a868", activations: "#c44e52",
                temporaries: "#8172b3", batch: "#937860", communication: "#da8bc3"};
function unit(largest) {  // [name, bytes] of the unit that shows `largest` best
  return largest >= 1024 * MiB ? ["GiB", 1024 * MiB] : largest >= MiB ? ["MiB", MiB] : ["KiB", 1024];
}
function inUnit(b) { const [name, size] = unit(b); return (b / size).toFixed(1) + " " + name; }
function fmtBytes(b) {
  return b == null ? "-" : inUnit(b) + " (" + Math.round(b).toLocaleString("en") + " B)";
}
function times(v) { return v == null ? "-" : v.toFixed(2) + "x"; }
function el(tag, attrs, text) {  // attributes and text only: nothing from the data is ever parsed as markup
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text != null) e.textContent = text;
  return e;
}
function plotText(text) {  // plotly reads a few tags, and $...$ as TeX, in its labels: the data's text as it is
  return String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/\$/g, "&#36;");
}
function cell(row, column, kind) {
  const v = row[column];
  if (v == null || v === "") return ["-", ""];
  if (kind === "bytes") return [inUnit(v), v];
  if (kind === "ratio") return [Number(v).toFixed(2) + "x", v];
  if (kind === "ms") return [Number(v).toFixed(1) + (row.noisy ? "~" : ""), v];
  if (kind === "interval") return [String(v), row.step_time_ms_ci95_low == null ? "" : row.step_time_ms_ci95_low];
  if (kind === "growth") return [Math.round(v).toLocaleString("en") + " B/step", v];
  return [String(v), String(v)];
}
function table(rows, columns) {
  const t = el("table", {class: "results"});
  const head = el("tr");
  columns.forEach(([column, heading, kind], i) => {
    const th = el("th", {"data-kind": kind}, heading);
    th.addEventListener("click", () => sortBy(t, i, kind, th));
    head.appendChild(th);
  });
  t.appendChild(el("thead")).appendChild(head);
  const body = t.appendChild(el("tbody"));
  for (const row of rows) {
    const tr = el("tr", {class: row.status !== "ok" ? "bad" : (row.verified === "NO" ? "mismatch" : "")});
    for (const [column, , kind] of columns) {
      const [text, value] = cell(row, column, kind);
      const td = el("td", {"data-value": value, "data-column": column, class: kind === "text" ? "" : "num"}, text);
      if (kind === "bytes" && row[column] != null) td.title = fmtBytes(row[column]);
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
  const wrap = el("div", {class: "scroll"});
  wrap.appendChild(t);
  return wrap;
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
function notes(id, lines, cls) {
  const box = document.getElementById(id);
  for (const line of lines) box.appendChild(el("p", {class: cls || "note"}, line));
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
    const timed = ok.filter(r => r.step_time_ms_median != null);
    // both boxes first, so that each chart is drawn at its width beside the other
    const time = timed.length ? wrap.appendChild(el("div", {class: "chart"})) : null;
    const names = ok.map(r => plotText(r.strategy + (r.pitfall ? " (pitfall)" : "")));
    const [memUnit, memSize] = unit(Math.max(...ok.map(r => r.peak_mem_bytes)));
    Plotly.newPlot(mem, [{type: "bar", x: names, y: ok.map(r => r.peak_mem_bytes / memSize),
      customdata: ok.map(r => [fmtBytes(r.peak_mem_bytes), times(r.mem_vs_baseline), r.verified]),
      hovertemplate: "%{x}<br>peak %{customdata[0]}<br>%{customdata[1]} of the baseline<br>" +
                     "matches baseline: %{customdata[2]}<extra></extra>",
      marker: {color: ok.map(r => r.verified === "NO" ? "#e0a030" : "#4c72b0")}}],
      {title: {text: DATA.kind === "predict" ? "predicted peak (" + memUnit + ")" : "peak memory (" + memUnit + ")"},
       margin: {t: 40, b: 90, l: 50, r: 10}, yaxis: {title: {text: memUnit}}},
      {displayModeBar: false, responsive: true});
    if (!time) continue;
    Plotly.newPlot(time, [{type: "bar", x: timed.map(r => plotText(r.strategy)), y: timed.map(r => r.step_time_ms_median),
      error_y: {type: "data", symmetric: false,
                array: timed.map(r => r.step_time_ms_ci95_high == null ? 0
                                      : r.step_time_ms_ci95_high - r.step_time_ms_median),
                arrayminus: timed.map(r => r.step_time_ms_ci95_low == null ? 0
                                           : r.step_time_ms_median - r.step_time_ms_ci95_low)},
      customdata: timed.map(r => [r.step_time_ms_ci, times(r.time_vs_baseline)]),
      hovertemplate: "%{x}<br>median %{y:.1f} ms<br>95% CI %{customdata[0]} ms<br>" +
                     "%{customdata[1]} of the baseline<extra></extra>",
      marker: {color: "#55a868"}}],
      {title: {text: "step time (ms, median and 95% CI)"}, margin: {t: 40, b: 90, l: 50, r: 10},
       yaxis: {title: {text: "ms"}}},
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
  const top = Math.max(t.peak.bytes, ...(t.reserved || []).map(v => v || 0));
  const [yUnit, ySize] = unit(top);
  const traces = DATA.categories.map(c => ({type: "scatter", mode: "lines", stackgroup: "live", name: c, x: t.x,
    y: t.live[c].map(v => v / ySize), line: {width: 0.5, color: COLORS[c]},
    customdata: t.live[c].map((v, i) => [fmtBytes(v), plotText(t.stage[i])]),
    hovertemplate: c + ": %{customdata[0]}<br>stage %{customdata[1]}<extra></extra>"}));
  const total = t.x.map((_, i) => DATA.categories.reduce((s, c) => s + t.live[c][i], 0));
  const drawn = total.reduce((m, v) => Math.max(m, v), 0);
  target.setAttribute("data-drawn-peak-bytes", String(drawn));
  if (t.reserved) {
    traces.push({type: "scatter", mode: "lines", name: "reserved (modelled)", x: t.x, y: t.reserved.map(v => v / ySize),
      line: {color: "#444", dash: "dash", width: 1.2}, customdata: t.reserved.map(v => fmtBytes(v)),
      hovertemplate: "reserved %{customdata}<extra></extra>"});
    target.setAttribute("data-drawn-reserved-bytes", String(t.reserved.reduce((m, v) => Math.max(m, v), 0)));
  }
  if (predicted) {
    const ptotal = predicted.x.map((_, i) => DATA.categories.reduce((s, c) => s + predicted.live[c][i], 0));
    traces.push({type: "scatter", mode: "lines", name: plotText("predicted (" + (predicted.source || "") + ")"),
      x: predicted.x, y: ptotal.map(v => v / ySize), line: {color: "#000", dash: "dot", width: 1.5},
      customdata: ptotal.map(v => fmtBytes(v)), hovertemplate: "predicted %{customdata}<extra></extra>"});
    target.setAttribute("data-predicted-peak-bytes", String(ptotal.reduce((m, v) => Math.max(m, v), 0)));
  }
  const p = t.peak;
  const where = [p.module || "(no module)", p.stage, p.op ? "aten::" + p.op : ""].filter(Boolean).join(" · ");
  const annotations = [{x: t.x[p.position], y: drawn / ySize, text: "peak " + inUnit(drawn) + "<br>" + plotText(where),
                        showarrow: true, arrowhead: 2, ax: 0, ay: -36, font: {size: 11}}];
  Plotly.newPlot(target, traces, {title: {text: plotText(title), font: {size: 13}}, margin: {t: 70, r: 10, l: 50},
    xaxis: {title: {text: "fraction of the step's allocator events"}, range: [0, 1]},
    yaxis: {title: {text: "live " + yUnit}}, shapes: stageShapes(t), annotations, legend: {orientation: "h", y: -0.3},
    hovermode: "x unified"}, {displayModeBar: false, responsive: true});
}
function largestTable(t) {
  const rows = (t.largest || []).map(a => ({bytes: a.bytes, category: a.category, module: a.module,
    op: a.op ? "aten::" + a.op : "", stage: a.stage, status: "ok"}));
  return table(rows, [["bytes", "size", "bytes"], ["category", "category", "text"], ["module", "module", "text"],
                      ["op", "operator", "text"], ["stage", "stage", "text"]]);
}
function timelines() {
  const box = document.getElementById("timelines");
  if (!DATA.timelines.length) {
    box.appendChild(el("p", {class: "note"}, "No snapshots: run with --snapshot to draw these."));
    return;
  }
  for (const tl of DATA.timelines) {
    const c = tl.case;
    const kind = tl.ranks[0] && tl.ranks[0].kind === "predicted" ? "predicted · " : "";
    box.appendChild(el("h3", {}, kind + [c.strategy, c.phase, "batch " + c.batch_size, c.workload, c.device].join(" · ")));
    const wrap = box.appendChild(el("div", {class: "ranks"}));
    // every rank's box first, so that each chart is drawn at its width beside the others
    const divs = tl.ranks.map(t => {
      const cellBox = wrap.appendChild(el("div"));
      const chart = cellBox.appendChild(el("div", {class: "chart timeline", "data-strategy": c.strategy,
        "data-phase": c.phase, "data-batch-size": String(c.batch_size), "data-workload": c.workload,
        "data-kind": t.kind == null ? "" : String(t.kind), "data-rank": t.rank == null ? "" : String(t.rank),
        "data-row-peak-bytes": tl.row_peak_bytes == null ? "" : String(tl.row_peak_bytes)}));
      cellBox.appendChild(el("p", {class: "note"}, "The largest live tensors at the peak:"));
      cellBox.appendChild(largestTable(t));
      return chart;
    });
    tl.ranks.forEach((t, i) => {
      const title = (t.rank == null ? "" : "rank " + t.rank + ": ") + (t.kind === "predicted" ? "predicted " : "") +
                    "peak " + fmtBytes(t.peak.bytes);
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
      text: plan.label.map(plotText), textposition: "top center",
      hovertemplate: "%{text}<br>%{x:.1f} ms<br>%{y:.1f} MiB<extra></extra>"}],
      {xaxis: {title: {text: plotText(plan.time_column)}}, yaxis: {title: {text: plotText(plan.peak_column) + " (MiB)"}},
       margin: {t: 30, l: 50, r: 10}},
      {displayModeBar: false, responsive: true});
  }
}
notes("skipped", DATA.skipped);
notes("verdicts", DATA.verdicts, "verdict");
const main = DATA.rows.filter(r => !r.pitfall), pitfalls = DATA.rows.filter(r => r.pitfall || r.eval_baseline);
document.getElementById("results").appendChild(table(main, DATA.columns));
if (DATA.noisy_note) notes("results", [DATA.noisy_note]);
if (pitfalls.length) {
  notes("pitfalls", [DATA.pitfall_note]);
  document.getElementById("pitfalls").appendChild(table(pitfalls, DATA.pitfall_columns));
} else notes("pitfalls", ["No pitfall in this run."]);
barCharts();
timelines();
plans();
// wider than the window: something is cut off (or scrolls sideways)
document.body.setAttribute("data-scroll-width", String(document.documentElement.scrollWidth));
document.body.setAttribute("data-window-width", String(window.innerWidth));
document.body.setAttribute("data-render-ms", String(Math.round(performance.now())));  // since navigation began
document.body.setAttribute("data-report-ready", "1");
"""
