"""`report --html` seen as a person sees it: REPORT.html opened in a real headless Chromium (Debian's `chromium`,
installed here where it is absent and the machine can; skipped with the reason otherwise) logs nothing to the
console, fetches nothing (its Content-Security-Policy would block and log any request, and a control page shows that
such a request is caught), draws charts (a screenshot that is not blank), and the memory timeline it draws peaks at
the CSV's `peak_mem_bytes`, with the prediction of the same case overlaid at the predicted peak.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
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
    """(stdout, the console's messages, seconds) of one headless Chromium run on `page`."""
    started = time.perf_counter()
    done = subprocess.run([chromium, *BROWSER_FLAGS, *extra, page.resolve().as_uri()], capture_output=True,
                          text=True, timeout=120)
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    return done.stdout, console, time.perf_counter() - started


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    """A compare run with snapshots, a prediction of the same cases with snapshots, and the HTML report of both."""
    pytest.importorskip("plotly", reason="report --html needs plotly (pip install 'membench[report]')")
    out = tmp_path_factory.mktemp("html-report")
    common = ["--workload", MLP, "--batch-size", "4", "--device", "cpu", "--snapshot", "--out", str(out)]
    assert main(["compare", "--strategies", "checkpoint", "--quick", "--threads", "1", *common]) == 0
    assert main(["predict", "--strategies", "checkpoint", "--threads", "1", *common]) == 0
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
