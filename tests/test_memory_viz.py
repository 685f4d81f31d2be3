"""membench's snapshot files drawn by PyTorch's own viewer, MemoryViz.js (the page behind pytorch.org/memory_viz), in
headless Chromium: every kind membench writes (a measured CPU case of `compare --snapshot`, `predict --snapshot` on
the CPU and on CUDA's caching-allocator model; on a GPU, what CUDA records) in each of the viewer's three views,
without a JavaScript error: the Active Memory Timeline peaking at the CSV's peak, hovered and zoomed, the Allocator
State History listing every event of the trace, each one clicked.

The viewer is not shipped in torch's wheel and is other projects' code (it imports d3 from a CDN), so it is not in
this repository: `make memory-viz` puts a local copy and its d3 modules in .cache/memory_viz/
(tools/viewer/memory_viz.py), and these tests skip, saying so, without it. The page is served from 127.0.0.1 (the viewer is an ES module, which
Chromium does not run from file://), with an import map from the viewer's CDN addresses to the local modules, so
MemoryViz.js runs unchanged; the test page loads the files with the viewer's own `add_local_files` (what
`torch.cuda._memory_viz.trace_plot` pages do) and picks each view with the viewer's own menus.
"""

from __future__ import annotations

import base64
import functools
import html
import http.server
import json
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pandas as pd
import pytest

from bench.cli.main import main
from bench.core.snapshots import device_trace, read_snapshot, replay_peaks
from test_html_report import BROWSER_FLAGS, chromium  # noqa: F401  (the fixture: Chromium, installed or skipped)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "viewer"))
from memory_viz import CACHE  # noqa: E402  (.cache/memory_viz/, or $MEMORY_VIZ_DIR)
MLP = "deep_mlp:layers=4:width=8"
VIEWS = ("Active Memory Timeline", "Allocator State History", "Active Cached Segment Timeline")


@pytest.fixture(scope="module")
def viewer() -> Path:
    """The local copy of MemoryViz.js and its modules (`make memory-viz`); the tests skip without it."""
    missing = [name for name in ("MemoryViz.js", "importmap.json") if not (CACHE / name).is_file()]
    if missing:
        pytest.skip(f"no local copy of PyTorch's MemoryViz.js in {CACHE} (missing {', '.join(missing)}): "
                    "`make memory-viz` puts one there (it downloads the viewer from the pinned torch's tag on "
                    "GitHub, or copies MEMORY_VIZ_JS=path, and d3 from the npm registry)")
    return CACHE


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A measured compare run, and predictions on the CPU and on CUDA's allocator model, all with snapshots."""
    out = tmp_path_factory.mktemp("memory-viz-runs")
    common = ["--workload", MLP, "--batch-size", "4", "--threads", "1", "--snapshot", "--out", str(out)]
    assert main(["compare", "--strategies", "checkpoint", "--quick", "--device", "cpu", *common]) == 0
    assert main(["predict", "--strategies", "baseline,checkpoint", "--device", "cpu", *common]) == 0
    assert main(["predict", "--strategies", "baseline,checkpoint", "--device", "cuda", "--engine", "fake", *common]) == 0
    return out


def _cases(folder: Path) -> list[tuple[Path, dict, pd.Series]]:
    """(snapshot file, snapshot, its CSV row) for every snapshot of every run in `folder`."""
    out = []
    for csv in sorted(p for p in folder.glob("*.csv") if not p.name.endswith(".timeline.csv")):
        rows = pd.read_csv(csv)
        for path in sorted(folder.glob(f"{csv.stem}.snapshots/*.pickle")):
            snapshot = read_snapshot(path)
            about = snapshot["membench"]
            [row] = [r for _, r in rows.iterrows() if (r["strategy"], r["phase"], r["device"]) ==
                     (about["strategy"], about["phase"], about["device"])]
            out.append((path, snapshot, row))
    return out


PAGE = """<!DOCTYPE html><html><head><meta charset="utf-8"><title>membench files in MemoryViz.js</title>
<script type="importmap">IMPORT_MAP</script>
<script>
// every error the page meets: thrown (a module that fails to load included: capture phase), rejected or logged
window.membenchErrors = [];
window.addEventListener("error", e => membenchErrors.push(
  e.message ? `${e.message} (${e.filename}:${e.lineno})` : `could not load ${e.target.src || e.target.href}`), true);
window.addEventListener("unhandledrejection", e => membenchErrors.push(`unhandled rejection: ${e.reason}`));
const consoleError = console.error;
console.error = (...args) => { membenchErrors.push(args.join(" ")); consoleError(...args); };
</script></head><body>
<script type="module">
import {add_local_files} from "./MemoryViz.js";
const files = FILES;
const shownView = () => [...document.querySelectorAll("body > div")].filter(
  // the view the viewer is showing: it sets "display: float" (not a CSS value) on it, "display: none" on the others
  d => (d.getAttribute("style") || "").includes("display: float"));
// until the view is drawn: the Allocator State History draws in the viewer's requestAnimationFrame callback, which
// highlights the event it shows; at most 5 s
async function drawn(view) {
  for (let waited = 0; waited < 5000; waited += 50) {
    const shown = shownView();
    if (shown.length === 1 && (view !== VIEWS[1] || shown[0].querySelector("pre[style*=background-color]"))) return;
    await new Promise(done => setTimeout(done, 50));
  }
}
// the viewer's own menus: its first <select> picks the file, its second the view
const [fileMenu, viewMenu] = document.querySelectorAll("select");
// an error the viewer throws is recorded (and the page goes on to the next file and view)
const attempt = action => { try { action(); } catch (error) { membenchErrors.push(`${error} ${error.stack}`); } };
attempt(() => add_local_files(files, VIEWS[0]));
await drawn(VIEWS[0]);
const results = [];
for (const file of files) {
  for (const view of VIEWS) {
    const errors = membenchErrors.length;
    fileMenu.value = file.name;
    viewMenu.value = view;
    attempt(() => fileMenu.dispatchEvent(new Event("change")));
    await drawn(view);
    const shown = shownView();
    const result = {file: file.name, view, errors: membenchErrors.slice(errors), shown: shown.length};
    if (shown.length === 1) {
      const div = shown[0];
      // the Active Memory/Cached Segment Timeline: one polygon per allocation drawn, one for the small ones
      // summarized; the top of the stack over time is the most the view shows
      const polygons = [...div.querySelectorAll("svg")].slice(0, 1).flatMap(s => [...s.querySelectorAll("polygon")]);
      result.polygons = polygons.length;
      let top = 0;
      for (const p of polygons) {
        const d = p.__data__;
        d.offsets.forEach((offset, i) => {
          const size = Array.isArray(d.size) ? d.size[i] : d.size;
          if (size !== undefined) top = Math.max(top, offset + size);
        });
      }
      result.drawn_max = top;
      result.legend = [...div.querySelectorAll("svg text")].map(t => t.textContent).filter(t => /^[a-z_]+$/.test(t));
      if (view !== VIEWS[1]) {
        // hovering an allocation shows its frames below the plot; the largest one's, as a person sees it
        const before = membenchErrors.length;
        polygons.forEach(p => attempt(() => p.dispatchEvent(new MouseEvent("mouseover", {bubbles: true}))));
        const largest = polygons.filter(p => p.__data__.elem !== "summarized").sort(
          (a, b) => b.__data__.size - a.__data__.size)[0];
        if (largest) attempt(() => largest.dispatchEvent(new MouseEvent("mouseover", {bubbles: true})));
        result.context = div.querySelector(":scope > div > div > pre")?.textContent;
        // a wheel over the plot zooms it (the viewer reads d3.event, which d3-zoom sets: one d3 for all modules)
        const plot = div.querySelector("svg g[clip-path]");
        attempt(() => plot.dispatchEvent(new WheelEvent("wheel", {deltaY: -500, bubbles: true, cancelable: true})));
        result.zoomed = plot.querySelector("g").getAttribute("transform");
        result.hover_errors = [...new Set(membenchErrors.slice(before))];
      }
      result.rects = div.querySelectorAll("svg rect").length;
      if (view === VIEWS[1]) {
        // the Allocator State History: one <pre> per event of the trace (not the stack text's <pre>), segments and
        // blocks as rectangles; a click on each event draws the memory as it was then (the viewer replays back)
        const before = membenchErrors.length;
        const events = [...div.querySelectorAll(":scope > div > div > pre")];
        result.events = events.length;
        events.forEach(pre => attempt(() => pre.dispatchEvent(new MouseEvent("mousedown", {bubbles: true}))));
        result.clicked = events.length;
        result.click_errors = [...new Set(membenchErrors.slice(before))];
      }
    }
    results.push(result);
  }
}
const out = document.createElement("pre");
out.id = "membench-result";
out.textContent = JSON.stringify({results, errors: membenchErrors});
document.body.appendChild(out);
</script></body></html>
"""


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def _serve(folder: Path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


# the page and the viewer load from 127.0.0.1 alone: every other host stays unresolved (the viewer's CDN included)
# (in virtual time, 36 views a page: a budget of its own, with animation frames run in it)
FLAGS = [f for f in BROWSER_FLAGS if not f.startswith(("--host-resolver-rules", "--virtual-time-budget"))] + [
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", "--virtual-time-budget=200000",
    "--run-all-compositor-stages-before-draw"]


def _browse(chromium: str, url: str) -> tuple[str, list[str]]:
    """(the DOM once the page's scripts are done, the console's messages) of `url` in headless Chromium, in a
    profile of its own."""
    with tempfile.TemporaryDirectory(prefix="membench-chromium-") as profile:
        done = subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
                              capture_output=True, text=True, timeout=180)
    return done.stdout, [line for line in done.stderr.splitlines() if ":CONSOLE" in line]


def _name(path: Path) -> str:
    """The file's name in the viewer's menu: its run's folder and its own name (runs name their cases alike)."""
    return f"{path.parent.name}/{path.name}"


def _draw(chromium: str, viewer: Path, files: list[Path], tmp_path: Path) -> tuple[dict, list[str]]:
    """Every file in every view of the viewer, in one page: ({"results": [...], "errors": [...]}, console lines)."""
    site = tmp_path / "site"
    site.mkdir()
    for name in ("MemoryViz.js", "modules"):
        (site / name).symlink_to(viewer / name)
    import_map = json.loads((viewer / "importmap.json").read_text())
    payload = [{"name": _name(path), "base64": base64.b64encode(path.read_bytes()).decode()} for path in files]
    # the files last: their base64 may hold the other placeholders' names
    (site / "index.html").write_text(PAGE.replace("IMPORT_MAP", json.dumps(import_map))
                                     .replace("VIEWS", json.dumps(VIEWS)).replace("FILES", json.dumps(payload)))
    server = _serve(site)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/index.html"
        dom, console = _browse(chromium, url)
    finally:
        server.shutdown()
    found = re.search(r'<pre id="membench-result">(.*?)</pre>', dom, re.S)
    assert found, f"the page did not finish; console: {console}"
    return json.loads(html.unescape(found.group(1))), console


def _expected_events(trace: list[dict]) -> int:
    """The events the Allocator State History lists: a free_requested followed by its free_completed is one."""
    count, previous = 0, None
    for event in trace:
        if not (event["action"] == "free_completed" and previous is not None
                and previous["action"] == "free_requested" and previous["addr"] == event["addr"]):
            count += 1
        previous = event
    return count


def _drawn_without_errors(cases: list[tuple[Path, dict, pd.Series]], drawn: dict, console: list[str]) -> dict:
    """{(file, view): what the page found}, once no view threw, rejected or logged an error and each was shown."""
    assert [(r["file"], r["click_errors"]) for r in drawn["results"] if r.get("click_errors")] == []
    assert drawn["errors"] == [], drawn["errors"]
    assert not [line for line in console if "Uncaught" in line or "Failed to load" in line], console
    by_view = {(r["file"], r["view"]): r for r in drawn["results"]}
    assert len(by_view) == 3 * len(cases)
    for path, snapshot, _ in cases:
        for view in VIEWS:
            result = by_view[(_name(path), view)]
            assert result["shown"] == 1 and result["errors"] == [] and not result.get("hover_errors"), result
        timeline, history = by_view[(_name(path), VIEWS[0])], by_view[(_name(path), VIEWS[1])]
        assert timeline["polygons"] >= 2 and (timeline["zoomed"] or "").startswith("translate"), timeline
        assert history["events"] == _expected_events(device_trace(snapshot)), history
        assert history["clicked"] == history["events"], history
    return by_view


def test_the_viewer_draws_every_kind_of_membench_snapshot_in_every_view(viewer, chromium, runs, tmp_path):
    cases = _cases(runs)
    kinds = {(snapshot["membench"]["source"], snapshot["membench"].get("kind")) for _, snapshot, _ in cases}
    assert len(kinds) == 3, kinds  # measured on the CPU, predicted on the CPU, CUDA's allocator model
    # the viewer reads pickle protocols 2-4 (Python 3.14 writes 5 by default): membench writes 4
    assert {path.read_bytes()[:2] for path, _, _ in cases} == {b"\x80\x04"}
    by_view = _drawn_without_errors(cases, *_draw(chromium, viewer, [path for path, _, _ in cases], tmp_path))
    for path, snapshot, row in cases:
        trace = device_trace(snapshot)
        allocated, reserved = replay_peaks(snapshot)
        peak = row["peak_mem_bytes"] if "peak_mem_bytes" in row and pd.notna(row["peak_mem_bytes"]) \
            else row["predicted_bytes"]
        assert allocated == peak  # tests/test_snapshot.py checks this too; here it ties the drawing to the CSV
        timeline = by_view[(_name(path), VIEWS[0])]
        allocs = sum(e["action"] == "alloc" for e in trace)
        assert timeline["polygons"] == allocs + 1, timeline  # every allocation, and the summarized small ones
        assert timeline["drawn_max"] == peak, (_name(path), timeline["drawn_max"], peak)
        largest = max((e for e in trace if e["action"] == "alloc"), key=lambda e: e["size"])
        # the viewer's text for it: its size and membench's frames (operator, module, stage)
        assert f"({largest['size']} bytes)" in timeline["context"], timeline["context"]
        assert all(f"{frame}:0:" in timeline["context"] for frame in ("operator", "module", "stage")), timeline
        assert set(timeline["legend"]) == {e["category"] for e in trace if "category" in e}, timeline["legend"]
        assert by_view[(_name(path), VIEWS[1])]["rects"] >= len(snapshot["segments"])
        if reserved is not None:  # the allocator model's segments: the cached segment timeline peaks at reserved
            segments = by_view[(_name(path), VIEWS[2])]
            assert segments["drawn_max"] == reserved == row["predicted_reserved_bytes"], segments


@pytest.mark.cuda
def test_the_viewer_draws_a_snapshot_that_cuda_recorded(viewer, chromium, tmp_path):
    """On a GPU: the snapshots `compare --device cuda --snapshot` takes with torch's own recorder (PyTorch's frames,
    no categories, blocks allocated before recording began) drawn in every view without an error."""
    out = tmp_path / "runs"
    assert main(["compare", "--strategies", "checkpoint", "--quick", "--device", "cuda", "--workload", MLP,
                 "--batch-size", "4", "--threads", "1", "--snapshot", "--out", str(out)]) == 0
    cases = _cases(out)
    assert cases and {s["membench"]["source"] for _, s, _ in cases} == {"cuda_record_memory_history"}
    by_view = _drawn_without_errors(cases, *_draw(chromium, viewer, [path for path, _, _ in cases], tmp_path))
    for path, snapshot, _ in cases:
        # what was allocated before recording began is drawn too (the blocks of the segments, the frees without an
        # alloc): the viewer's peak is about the replayed one (not run yet: no machine of this project has a GPU)
        drawn, replayed = by_view[(_name(path), VIEWS[0])]["drawn_max"], replay_peaks(snapshot)[0]
        assert abs(drawn - replayed) <= 0.05 * replayed, (_name(path), drawn, replayed)


def test_the_offline_viewer_page_opens_without_errors(viewer, chromium):
    """`make memory-viz`'s index.html (served as docs/measuring.md says) is the viewer's drop page, as at
    pytorch.org/memory_viz: its three menus and the line asking for a file, with nothing failing to load."""
    server = _serve(viewer)
    try:
        dom, console = _browse(chromium, f"http://127.0.0.1:{server.server_address[1]}/index.html")
    finally:
        server.shutdown()
    assert dom.count("<select>") == 3 and "Drag and drop a file to load a local snapshot" in dom, dom[-2000:]
    assert "<option>Active Memory Timeline</option>" in dom
    assert not [line for line in console if "Uncaught" in line or "Failed to load" in line or "404" in line], console
