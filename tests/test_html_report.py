"""`report --html` seen as a person sees it: REPORT.html opened in a real headless Chromium (Debian's `chromium`,
installed here where it is absent and the machine can; skipped with the reason otherwise) logs nothing to the
console, fetches nothing (its Content-Security-Policy would block and log any request, and a control page shows that
such a request is caught), draws charts (a screenshot that is not blank), and the memory timeline it draws peaks at
the CSV's `peak_mem_bytes`, with the prediction of the same case overlaid at the predicted peak; a results folder
whose every text is hostile is drawn whole, as text, at 420 px, with nothing injected or run; a predict CSV is a page
of its predicted snapshots.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest

from bench.cli.main import main
from bench.core.errors import UsageError
from bench.report import html as html_report
from bench.report import html_page

MLP = "deep_mlp:layers=4:width=8"
BROWSER_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr",
                 "--v=0", "--host-resolver-rules=MAP * ~NOTFOUND", "--virtual-time-budget=15000"]


def _install_chromium() -> tuple[str | None, str]:
    """The chromium executable, installed with apt-get where it is absent and this user can; (None, why) else."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found, ""
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return None, "no chromium, and apt-get is missing or needs root to install it"
    try:
        for command in (["apt-get", "update"], ["apt-get", "install", "-y", "chromium"]):
            subprocess.run(command, check=True, capture_output=True, timeout=600)
    except (subprocess.SubprocessError, OSError) as error:
        return None, f"chromium could not be installed with apt-get: {type(error).__name__}"
    found = shutil.which("chromium")
    return found, "" if found else "apt-get installed no chromium executable"


@pytest.fixture(scope="module")
def chromium() -> str:
    path, why = _install_chromium()
    if path is None:
        pytest.skip(why)
    return path


def _browse(chromium: str, page: Path, *extra: str) -> tuple[str, list[str], float]:
    """(stdout, the console's messages, seconds) of one headless Chromium run on `page`, in a profile of its own: a
    browser started on a profile in use hands the page to that one (another test session's, a person's)."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="membench-chromium-") as profile:
        done = subprocess.run([chromium, *BROWSER_FLAGS, f"--user-data-dir={profile}", *extra,
                               page.resolve().as_uri()], capture_output=True, text=True, timeout=120)
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    return done.stdout, console, time.perf_counter() - started


def _browse_at_width(chromium: str, page: Path, width: int, *extra: str) -> tuple[str, list[str]]:
    """(the DOM once drawn, the console's messages) of `page` in a frame `width` CSS pixels wide: headless Chromium
    will not make its window narrower than 500 px, so a page beside it holds the report in an <iframe> and copies
    the report's DOM, once its script has run to its end, into a <textarea> (whose text the DOM dump escapes)."""
    wrapper = page.with_name(f"{page.stem}.at-{width}px.html")
    wrapper.write_text(f"""<!DOCTYPE html><html><body style="margin:0">
<iframe id="frame" src="{page.name}" width="{width}" height="900" style="border:0"></iframe>
<textarea id="inner"></textarea><script>
const frame = document.getElementById("frame");
function copy() {{
  const d = frame.contentDocument;
  if (d && d.body && d.body.getAttribute("data-report-ready")) {{
    document.getElementById("inner").textContent = d.documentElement.outerHTML;
  }} else setTimeout(copy, 50);
}}
frame.addEventListener("load", copy);
</script></body></html>""")
    dom, console, _ = _browse(chromium, wrapper, "--dump-dom", "--allow-file-access-from-files", *extra)
    inner = re.search(r'<textarea id="inner">(.*)</textarea>', dom, re.S)
    return html.unescape(inner.group(1)) if inner else "", console


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    """A compare run with snapshots, a prediction of the same cases with snapshots, and the HTML report of both."""
    pytest.importorskip("plotly", reason="report --html needs plotly (pip install 'membench[report]')")
    out = tmp_path_factory.mktemp("html-report")
    common = ["--workload", MLP, "--batch-size", "4", "--device", "cpu", "--snapshot", "--out", str(out)]
    assert main(["compare", "--strategies", "checkpoint", "--quick", "--threads", "1", *common]) == 0
    assert main(["predict", "--strategies", "baseline,checkpoint", "--threads", "1", *common]) == 0
    assert main(["report", "--results", str(out), "--html"]) == 0
    return out


def _results(folder: Path) -> pd.DataFrame:
    return pd.read_csv(_run_csv(folder))


def _run_csv(folder: Path) -> Path:
    [csv] = [p for p in folder.glob("2*.csv") if not p.name.endswith(".timeline.csv")]
    return csv


def _page(folder: Path) -> Path:
    return folder / f"{_run_csv(folder).stem}.REPORT.html"


def test_the_page_is_one_file_that_loads_nothing(report):
    page = _page(report).read_text()
    assert (report / f"{_run_csv(report).stem}.REPORT.md").exists() and list(report.glob("*.png"))  # the Markdown
    assert len(page.encode()) < html_report.PAGE_LIMIT_BYTES
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    assert not re.search(r"""<(script|link|img|iframe)[^>]+(src|href)=["']?(https?:)?//""", page)


def test_chromium_draws_the_timeline_to_the_csv_peak_without_errors_or_requests(report, chromium):
    dom, console, seconds = _browse(chromium, _page(report), "--dump-dom")
    assert console == [], console  # no error, no warning, no blocked request
    assert 'data-report-ready="1"' in dom, "the page's script did not run to its end"
    rows = _results(report)
    drawn = re.findall(r'<div ([^>]*class="chart timeline[^>]*)>', dom)
    assert len(drawn) == len(rows), drawn
    for attributes in drawn:
        values = dict(re.findall(r'(data-[a-z-]+)="([^"]*)"', html.unescape(attributes)))
        row = rows[(rows["strategy"] == values["data-strategy"]) & (rows["phase"] == values["data-phase"])].iloc[0]
        assert int(float(values["data-drawn-peak-bytes"])) == row["peak_mem_bytes"], values
        assert int(float(values["data-row-peak-bytes"])) == row["peak_mem_bytes"]
        assert "data-predicted-peak-bytes" in values  # the prediction of the same case, overlaid
    predicted = pd.read_csv(next(report.glob("predict-*.csv")))
    overlaid = sorted(int(v) for v in re.findall(r'data-predicted-peak-bytes="([0-9]+)"', dom))
    assert overlaid == sorted(int(v) for v in predicted["predicted_bytes"])
    assert seconds < 30


def test_a_request_from_the_page_would_be_caught(chromium, tmp_path):
    """The control for the test above: the same policy on a page that asks the network is blocked and says so."""
    control = tmp_path / "control.html"
    control.write_text(f'<!DOCTYPE html><html><head><meta http-equiv="Content-Security-Policy" '
                       f'content="{html_page.csp("1")}"></head><body><img src="http://example.invalid/x.png">'
                       f'<script>fetch("https://example.invalid/y").catch(() => 0)</script></body></html>')
    _, console, _ = _browse(chromium, control, "--dump-dom")
    assert any("example.invalid" in line and "Content Security Policy" in line for line in console), console


def test_the_charts_render_a_picture(report, chromium, tmp_path):
    from PIL import Image

    shot = tmp_path / "report.png"
    _browse(chromium, _page(report), f"--screenshot={shot}", "--window-size=1200,2000")
    image = Image.open(shot).convert("RGB").resize((300, 500))
    colors = image.getcolors(maxcolors=300 * 500)
    not_white = sum(count for count, rgb in colors if min(rgb) < 235) / (300 * 500)
    assert len(colors) > 100 and not_white > 0.05, (len(colors), not_white)


def test_html_without_plotly_is_one_line(monkeypatch, capsys, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "plotly.offline", None)  # import fails as if plotly were not installed
    with pytest.raises(UsageError, match="pip install"):
        html_report.plotly_bundle()


HOSTILE = ("<!--<script>\u2028</script><img src=x onerror=\"document.body.setAttribute('data-pwned','1')\">"
           "$TITLE $DATA $SCRIPT $CSP $PLOTLY '\"&amp;\u2029</style><b>")


def _hostile_folder(folder: Path) -> Path:
    """A results CSV whose every text cell is hostile (the run id, the names, the messages; one pitfall, one noisy
    row), a snapshot of its baseline whose module, operator and stage names are hostile, a plan CSV with hostile
    labels, and beside them a crafted pickle that would run code, a FIFO and a pickle of plain data that is no trace."""
    import os
    import pickle

    frame = pd.read_csv(Path(__file__).parent / "fixtures" / "single_batch.csv")
    for column in ("run_id", "workload", "device_name", "data", "message", "strategy_settings", "peak_stage",
                   "torch_version", "platform", "memory_method"):
        frame[column] = [f"{HOSTILE}{i}" for i in range(len(frame))] if column != "run_id" else HOSTILE
    frame["workload"] = HOSTILE  # one workload, so the verdicts and charts group the rows
    frame["strategy"] = [s if s == "baseline" else f"{HOSTILE}{s}" for s in frame["strategy"]]
    frame["strategy_role"] = ["pitfall" if i == 3 else "" for i in range(len(frame))]
    frame["noisy"] = [i == 2 for i in range(len(frame))]
    frame["step_time_ms_ci95_low"] = frame["step_time_ms_median"] * 0.9
    frame["step_time_ms_ci95_high"] = frame["step_time_ms_median"] * 1.1
    csv = folder / "20250301T120000Z-hostile.csv"
    frame.to_csv(csv, index=False)
    snapshots = folder / "20250301T120000Z-hostile.snapshots"
    snapshots.mkdir()
    about = {"workload": HOSTILE, "strategy": "baseline", "phase": "train", "batch_size": 100, "device": "cpu",
             "data": HOSTILE, "kind": "measured", "source": HOSTILE, "rank": None}
    trace = [{"action": "alloc", "addr": 4096 * i, "size": 1000 * (i + 1), "category": "activations",
              "module": HOSTILE, "op": HOSTILE, "stage": HOSTILE, "frames": []} for i in range(3)]
    (snapshots / "case.pickle").write_bytes(pickle.dumps({"segments": [], "device_traces": [trace],
                                                          "membench": about}))

    class RunsCode:
        def __reduce__(self):
            return (os.system, (f"touch {folder / 'pwned'}",))

    (snapshots / "crafted.pickle").write_bytes(pickle.dumps({"membench": RunsCode()}))
    os.mkfifo(snapshots / "fifo.pickle")
    (snapshots / "malformed.pickle").write_bytes(pickle.dumps({"membench": {"batch_size": "x"},
                                                               "device_traces": [[{"size": 1}]]}))
    pd.DataFrame({"plan": [HOSTILE, HOSTILE + "2"], "predicted_peak_bytes": [1e6, 2e6],
                  "step_time_ms": [1.0, 2.0]}).to_csv(folder / "plan-hostile.csv", index=False)
    return csv


def test_hostile_text_in_every_field_is_shown_as_text_and_runs_nothing(chromium, tmp_path):
    """Every text a results folder holds, hostile (`<!--<script>`, `</script><img onerror>`, the template's
    placeholder names, quotes, U+2028): Chromium at 420 px draws the whole page (its script runs to the end, every
    row in the table, the text shown as it was written), no injected element exists, nothing runs, no crafted
    pickle is loaded and the FIFO is not opened (it would block), and nothing is cut off at 420 px."""
    pytest.importorskip("plotly", reason="report --html needs plotly (pip install 'membench[report]')")
    csv = _hostile_folder(tmp_path)
    page, skipped = html_report.build_html([csv], tmp_path, f"{csv.stem}.REPORT.html")  # `report --html` prints these
    assert any("crafted.pickle: refused, it names posix.system" in line for line in skipped), skipped
    assert any("fifo.pickle: not a regular file" in line for line in skipped), skipped
    assert any("malformed.pickle: not a memory snapshot membench can draw" in line for line in skipped), skipped
    assert not (tmp_path / "pwned").exists()
    raw = page.read_text()
    assert raw.count("<script") == 3 and "<img" not in raw.split("<script>", 2)[2]  # no element from the data
    dom, console = _browse_at_width(chromium, page, 420)
    assert console == [], console  # no error, and no inline handler the policy had to refuse
    assert 'data-report-ready="1"' in dom and 'data-pwned="1"' not in dom
    assert not re.search(r"<img[^>]*src=\"?x", dom) and "<b>" not in dom
    rows = pd.read_csv(csv)
    shown = html.escape(HOSTILE.replace("\u2028", "\u2028"), quote=False)
    assert dom.count('data-column="message"') == len(rows) + 1  # every row, the baseline's eval twice (pitfalls)
    assert f"<h1>membench report: {shown}</h1>" in dom
    assert dom.count(f'data-column="strategy" class="">{shown}checkpoint<') == 2  # train, eval
    intervals = re.findall(r'data-value="([^"]*)" data-column="step_time_ms_ci"', dom)
    assert intervals and all(v == "" or float(v) >= 0 for v in intervals)  # sorted by its low end, as a number
    verdicts = re.findall(r'<p class="verdict">([^<]*)</p>', dom)
    assert len(verdicts) == 2 and all(v.startswith(shown + " · ") for v in verdicts), verdicts  # train, eval
    assert '<p class="note">No pitfall' not in dom and '<p class="note">~ noisy' in dom and re.search(r"[0-9]~<", dom)
    assert len(re.findall(r'class="chart timeline', dom)) == 1 and f'data-column="module" class="">{shown}<' in dom
    from bench.measure.stats import NOISE_THRESHOLD

    assert html_report.NOISE_THRESHOLD == NOISE_THRESHOLD  # the page's "~ noisy" line says the runner's threshold
    assert 'data-window-width="420"' in dom and int(re.search(r'data-scroll-width="(\d+)"', dom).group(1)) <= 420


def test_a_predict_csv_is_a_page_of_its_predicted_snapshots(chromium, tmp_path, capsys):
    """`report predict-….csv --html`: a page of its own (no REPORT.md: nothing was measured), each predicted
    snapshot drawn alone, its allocated bytes peaking at the row's `predicted_bytes` and the allocator model's
    reserved bytes at `predicted_reserved_bytes`, with the largest live blocks at the peak."""
    pytest.importorskip("plotly", reason="report --html needs plotly (pip install 'membench[report]')")
    assert main(["predict", "--workload", MLP, "--strategies", "baseline,checkpoint", "--phases", "train", "--device", "cuda",
                 "--engine", "fake", "--batch-size", "4", "--threads", "1", "--snapshot", "--out", str(tmp_path)]) == 0
    [csv] = tmp_path.glob("predict-*.csv")
    assert main(["report", str(csv)]) == 2 and "report --html" in capsys.readouterr().err
    assert main(["report", str(csv), "--html"]) == 0
    page = tmp_path / f"{csv.stem}.REPORT.html"
    assert page.exists() and not list(tmp_path.glob("*.REPORT.md"))
    dom, console, _ = _browse(chromium, page, "--dump-dom")
    assert console == [] and 'data-report-ready="1"' in dom, console
    predicted = pd.read_csv(csv)
    drawn = [dict(re.findall(r'(data-[a-z-]+)="([^"]*)"', html.unescape(a)))
             for a in re.findall(r'<div ([^>]*class="chart timeline[^>]*)>', dom)]
    assert len(drawn) == len(predicted) == 2
    for values in drawn:
        row = predicted[predicted["strategy"] == values["data-strategy"]].iloc[0]
        assert values["data-kind"] == "predicted"
        assert int(float(values["data-drawn-peak-bytes"])) == row["predicted_bytes"]
        assert int(float(values["data-drawn-reserved-bytes"])) == row["predicted_reserved_bytes"]
    assert dom.count("<p class=\"note\">The largest live tensors at the peak") == 2 and 'data-column="module" class="">' in dom
