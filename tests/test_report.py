"""The report reads CSV files only and writes legible charts plus REPORT.md; no model runs here."""

from __future__ import annotations

import ast
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from bench.report.markdown import build_report, newest_csv, parse_size

FIXTURES = Path(__file__).parent / "fixtures"
RUN_ID = "20250301T120000Z-f1x7"
FULL = FIXTURES / f"{RUN_ID}.csv"
TIMELINE = FIXTURES / f"{RUN_ID}.timeline.csv"
SINGLE = FIXTURES / "single_batch.csv"
ROOT = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk."""
    data = path.read_bytes()[:24]
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def full_report(tmp_path_factory) -> Path:
    """The report of the full fixture (every status, a mismatch, three batch sizes, a timeline), built once,
    in a fresh interpreter that then checks that building it imported neither torch nor the runner,
    strategies or workloads: charts read nothing but CSV files."""
    src = tmp_path_factory.mktemp("results")
    shutil.copy(FULL, src)
    shutil.copy(TIMELINE, src)
    out = tmp_path_factory.mktemp("report")
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "import bench.report.markdown\n"
        f"path = bench.report.markdown.build_report([Path({str(src / FULL.name)!r})], Path({str(out)!r}),\n"
        "                                  budget_bytes=bench.report.markdown.parse_size('1GiB'))\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'bench.run.runner', "
        "'strategies', 'workloads')))\n"
        "assert not bad, bad\n"
        "print('clean', path)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "clean" in done.stdout
    return out / f"{FULL.stem}.REPORT.md"


def test_report_reads_only_csv_and_never_imports_torch(full_report: Path):
    assert full_report.is_file()  # the fixture's subprocess asserted the modules; this test names the check
    for path in sorted((ROOT / "bench" / "report").glob("*.py")):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        bad = [n for n in names if n.split(".")[0] in ("torch", "strategies", "workloads")
               or n.startswith(("bench.run", "bench.measure", "bench.analysis"))]
        assert not bad, (path.name, bad)


def test_every_chart_is_a_legible_png(full_report: Path):
    out = full_report.parent
    for name in ("memory", "time", "pareto", "batch", "timeline"):
        path = out / f"{RUN_ID}.{name}.png"
        assert path.is_file(), f"missing {path.name}"
        width, height = png_size(path)
        assert width >= 800 and height >= 500, (path.name, width, height)
        assert path.stat().st_size > 10_000, path.name


def test_report_names_every_strategy_and_marks_problems(full_report: Path):
    text = full_report.read_text(encoding="utf-8")
    frame = pd.read_csv(FULL)
    for strategy in frame["strategy"].unique():
        assert f"`{strategy}`" in text, strategy
    for label in ("**OOM**", "**unsupported**", "**error**", "≠ baseline"):
        assert label in text, label
    # every non-ok message at the charted batch size is shown
    at_100 = frame[(frame["batch_size"] == 100) & (frame["status"] != "ok")]
    for message in at_100["message"].dropna().unique():
        assert message in text, message
    for name in ("memory", "time", "pareto", "batch", "timeline"):
        assert f"]({RUN_ID}.{name}.png)" in text, name
    assert "budget" in text.lower() and "1.0 GiB" in text
    assert "How to read" in text
    assert "skipped" not in text


def test_mismatched_rows_are_marked_in_the_table(full_report: Path):
    text = full_report.read_text(encoding="utf-8")
    amp_rows = [line for line in text.splitlines() if line.startswith("| `amp` |") and "ok" in line]
    assert amp_rows and all("no (≠ baseline)" in line for line in amp_rows)
    base_rows = [line for line in text.splitlines() if line.startswith("| `baseline` | ok")]
    assert base_rows and all("| yes |" in line for line in base_rows)


def test_a_mismatch_is_marked_where_every_row_was_verified(tmp_path: Path):
    # with no empty matches_baseline the column read back as numpy booleans, which `is False` never is: the
    # differs-by-design rows of an LLM run (lora, bf16_weights) were drawn and tabled as matches
    from bench.report.data import MISMATCH_LABEL, load_results, row_flag

    frame = pd.read_csv(SINGLE)
    frame = frame[frame["status"] == "ok"].copy()
    frame["matches_baseline"] = [row["strategy"] != "amp" for _, row in frame.iterrows()]
    assert (frame["strategy"] == "amp").any() and not frame["matches_baseline"].all()
    path = tmp_path / f"{RUN_ID}.csv"
    frame.to_csv(path, index=False)
    loaded = load_results(path)
    # as the bar charts take a cell's row: the first of the rows that match it
    flags = {name: row_flag(loaded[loaded["strategy"] == name].iloc[0]) for name in ("amp", "baseline")}
    assert flags["amp"] == MISMATCH_LABEL and flags["baseline"] is None, flags
    text = build_report([path], tmp_path / "out").read_text(encoding="utf-8")
    amp_rows = [line for line in text.splitlines() if line.startswith("| `amp` |")]
    assert amp_rows and all("no (≠ baseline)" in line for line in amp_rows), amp_rows


def test_single_batch_size_skips_chart_4_and_no_timeline_skips_chart_5(tmp_path: Path):
    src = tmp_path / "results"
    src.mkdir()
    shutil.copy(SINGLE, src / f"{RUN_ID}.csv")  # no timeline next to it
    report = build_report([src / f"{RUN_ID}.csv"], tmp_path / "out")
    text = report.read_text(encoding="utf-8")
    for name in ("memory", "time", "pareto"):
        assert (tmp_path / "out" / f"{RUN_ID}.{name}.png").is_file()
    assert not (tmp_path / "out" / f"{RUN_ID}.batch.png").exists()
    assert not (tmp_path / "out" / f"{RUN_ID}.timeline.png").exists()
    assert "single batch size" in text
    assert "no timeline file" in text


def test_two_devices_without_optional_columns_and_with_ci(tmp_path: Path):
    """A file with two devices gets one chart set each; missing optional columns are recomputed or left out,
    and CI columns, when present, replace the IQR."""
    frame = pd.read_csv(SINGLE)
    frame = frame[frame["strategy"].isin(["baseline", "checkpoint", "amp", "cudnn_benchmark"])]
    gpu = frame.assign(device="cuda", device_name="NVIDIA GeForce GTX 1650",
                       memory_method="cuda_max_memory_allocated")
    frame = pd.concat([frame, gpu]).drop(columns=["mem_vs_baseline", "time_vs_baseline", "peak_reserved_bytes",
                                                  "cudnn_version", "data"])
    frame["step_time_ms_ci95_low"] = frame["step_time_ms_median"] * 0.98
    frame["step_time_ms_ci95_high"] = frame["step_time_ms_median"] * 1.03
    path = tmp_path / f"{RUN_ID}.csv"
    frame.to_csv(path, index=False)
    text = build_report([path], tmp_path / "out").read_text(encoding="utf-8")
    for device in ("cpu", "cuda"):
        for name in ("memory", "time", "pareto"):
            assert (tmp_path / "out" / f"{RUN_ID}.{device}.{name}.png").is_file(), (device, name)
    assert "GTX 1650" in text
    assert "−42.0%" in text  # checkpoint train memory, recomputed from the baseline row
    assert "6,600.0 [6,468.0–6,798.0]" in text  # CI shown instead of the IQR


def test_a_run_over_two_kinds_of_gpu_is_grouped_by_device_name(tmp_path: Path):
    """A Ray sweep over a cluster with two GPU models: one chart set and one section per GPU model."""
    frame = pd.read_csv(SINGLE)
    frame = frame[frame["strategy"].isin(["baseline", "checkpoint"])].assign(device="cuda")
    frame = pd.concat([frame.assign(device_name="NVIDIA H100"), frame.assign(device_name="NVIDIA GeForce GTX 1650")])
    path = tmp_path / f"{RUN_ID}.csv"
    frame.to_csv(path, index=False)
    text = build_report([path], tmp_path / "out").read_text(encoding="utf-8")
    for name in ("NVIDIA_H100", "NVIDIA_GeForce_GTX_1650"):
        assert (tmp_path / "out" / f"{RUN_ID}.{name}.memory.png").is_file(), name
    assert "H100" in text and "GTX 1650" in text


@pytest.mark.parametrize("text, expected", [
    ("4GiB", 4 * 2**30), ("4 GiB", 4 * 2**30), ("1.5gib", 3 * 2**29), ("512MiB", 512 * 2**20),
    ("64KiB", 65536), ("4GB", 4_000_000_000), ("250MB", 250_000_000), ("3KB", 3000), ("123", 123),
    ("77B", 77), ("0.5 GB", 500_000_000),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "4 gigs", "-1GiB", "4PiB", "1,5GB", "four"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size|unit"):
        parse_size(text)


def test_newest_csv_skips_timelines_and_hidden_files(tmp_path: Path):
    older, newer = tmp_path / "20250101T000000Z-aaaa.csv", tmp_path / "20250102T000000Z-bbbb.csv"
    older.write_text("a\n")
    newer.write_text("a\n")
    now = time.time()
    os.utime(older, (now - 100, now - 100))
    os.utime(newer, (now - 50, now - 50))
    (tmp_path / "20250102T000000Z-bbbb.timeline.csv").write_text("a\n")
    (tmp_path / "fit-20250103T000000Z-cpu-cccc.csv").write_text("a\n")
    (tmp_path / ".20250103T000000Z-cccc.csv.tmp").write_text("a\n")
    (tmp_path / ".hidden.csv").write_text("a\n")
    assert newest_csv(tmp_path) == newer
    with pytest.raises(FileNotFoundError):
        newest_csv(tmp_path / "nothing-here")


def test_checkpointing_plans_get_a_tradeoff_chart_and_table(tmp_path):
    """Baseline, three checkpoint plans and a selective policy: one point each, the front marked, the floor."""
    from bench.core.results import write_rows

    def row(strategy, settings, peak, ms, **extra):
        return {"run_id": "20250301T120000Z-plan", "workload": "w", "strategy": strategy, "phase": "train",
                "device": "cpu", "batch_size": 100, "data": "synthetic", "status": "ok", "matches_baseline": True,
                "strategy_settings": settings, "peak_mem_bytes": peak and peak * 2**20, "step_time_ms_median": ms,
                "peak_params_bytes": 40 * 2**20, "peak_optimizer_bytes": 80 * 2**20, **extra}

    path = tmp_path / "20250301T120000Z-plan.csv"
    write_rows([
        # a plan's `recompute_plan_kind` and `recompute_plan`, as the run writes them from the strategy
        row("baseline", "", 700, 100, recompute_plan_kind="none", recompute_plan="none"),
        row("checkpoint:segments=2", "checkpoint.segments=2;checkpoint.plan=0-4", 600, 110,
            recompute_plan_kind="units", recompute_plan="0-4"),
        row("checkpoint:segments=3", "checkpoint.segments=3;checkpoint.plan=0-2 3-5", 650, 120,  # dominated
            recompute_plan_kind="units", recompute_plan="0-2 3-5"),
        row("checkpoint:budget=0.6", "checkpoint.segments=budget;checkpoint.plan=0-1 2-3 4-5 6-7", 420, 130,
            predicted_peak_bytes=410 * 2**20, recompute_plan_kind="units", recompute_plan="0-1 2-3 4-5 6-7"),
        row("selective_checkpoint", "selective_checkpoint.policy=compute", 650, 104,
            recompute_plan_kind="operators", recompute_plan="each unit, saving compute"),
        row("amp", "amp.dtype=bfloat16", 500, 50),  # not a checkpointing plan: not on this chart
        row("checkpoint:budget=0.3", "checkpoint.segments=budget;checkpoint.planning_s=None", None, None,
            status="unsupported", message="no plan of 17 fits; the smallest peak reachable is 415.0 MiB",
            recompute_plan_kind="units"),
    ], path)
    report = build_report([path], tmp_path).read_text(encoding="utf-8")
    assert (tmp_path / "20250301T120000Z-plan.tradeoff.png").is_file()
    table = report[report.index("### Checkpointing plans"):report.index("### Charts")]
    assert "`amp`" not in table
    lines = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| `")}
    assert lines["`checkpoint:budget=0.6`"].rstrip(" |").endswith("yes") and "410.0" in lines["`checkpoint:budget=0.6`"]
    assert "0-1 2-3 4-5 6-7" in lines["`checkpoint:budget=0.6`"]
    assert not lines["`checkpoint:segments=3`"].rstrip(" |").endswith("yes")  # beaten by segments=2 on both
    assert "each unit, saving compute" in lines["`selective_checkpoint`"]
    assert "weights + gradients + optimizer state): 160.0 MiB" in table  # 2 x 40 MiB + 80 MiB
    assert "`checkpoint:budget=0.3`: unsupported, no plan of 17 fits; the smallest peak reachable" in table
    assert "Budget plans were searched" not in table  # the budget=0.6 row's settings hold no planning time


@pytest.mark.parametrize("run_id", ["../../escaped", "/tmp/membench-escaped-report", "a/../../b"])
def test_a_run_id_from_a_file_never_steers_where_the_report_writes(tmp_path, run_id):
    """`run_id` is read from the CSV, which anyone may edit: chart names made from it stay inside --out."""
    results, out = tmp_path / "in" / "deep", tmp_path / "in" / "deep" / "out"
    results.mkdir(parents=True)
    frame = pd.read_csv(FULL)
    frame["run_id"] = run_id
    frame.to_csv(results / "edited.csv", index=False)
    before = {p for p in Path("/tmp").glob("membench-escaped-report*")}
    done = subprocess.run([sys.executable, "-m", "bench", "report", str(results / "edited.csv"), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "edited.csv"]
    assert written and all(out in p.parents for p in written), written
    assert {p for p in Path("/tmp").glob("membench-escaped-report*")} == before
    assert any(p.name.endswith(".memory.png") for p in written)


def test_charts_and_the_report_are_written_atomically(tmp_path, monkeypatch):
    """A report killed while it writes leaves the previous chart and REPORT.md whole, and no temporary file."""
    from bench.core import atomic
    from bench.report import figures, markdown

    markdown.build_report([FULL], tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def dies_halfway(self, path, **kwargs):
        Path(path).write_bytes(b"\x89PNG half")
        raise KeyboardInterrupt

    monkeypatch.setattr(figures.Figure, "savefig", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        markdown.build_report([FULL], tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    monkeypatch.undo()

    def killed_before_the_disk_has_it(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic.os, "fsync", killed_before_the_disk_has_it)  # REPORT.md half-written, then killed
    with pytest.raises(KeyboardInterrupt):
        markdown.build_report([FULL], tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_each_run_keeps_its_own_report(tmp_path, capsys):
    """`report --results DIR` reports the newest run under its own name: an earlier run's report (and page) stays
    as it was, and reporting the earlier run again rewrites only its own."""
    from bench.cli.main import main

    rows = pd.read_csv(FIXTURES / "single_batch.csv").head(2)  # baseline train and eval: two quick charts
    first, second = tmp_path / "20250101T000000Z-cpu-aaaa.csv", tmp_path / "20250102T000000Z-cpu-bbbb.csv"
    rows.assign(run_id=first.stem).to_csv(first, index=False)
    assert main(["report", str(first)]) == 0
    earlier = (tmp_path / f"{first.stem}.REPORT.md").read_text()
    rows.assign(run_id=second.stem, workload="second_model").to_csv(second, index=False)
    os.utime(second, (time.time() + 5, time.time() + 5))  # the newest
    assert main(["report", "--results", str(tmp_path)]) == 0
    assert f"wrote {tmp_path / f'{second.stem}.REPORT.md'}" in capsys.readouterr().out
    assert (tmp_path / f"{first.stem}.REPORT.md").read_text() == earlier
    assert "second_model" in (tmp_path / f"{second.stem}.REPORT.md").read_text()
    assert not (tmp_path / "REPORT.md").exists()


def test_the_budget_line_never_squashes_the_batch_chart(tmp_path, monkeypatch):
    from bench.report import line_charts as charts
    from bench.report.data import load_results, make_groups
    from cli_helpers import REFERENCE_CSV

    group = make_groups(load_results(REFERENCE_CSV))[0]
    highest = group.frame["peak_mem_bytes"].max()
    drawn = {}
    monkeypatch.setattr(charts, "save_figure", lambda fig, path: drawn.setdefault("fig", fig) and path)
    charts.chart_batch(group, tmp_path / "batch.png", budget_bytes=int(highest * 100))
    for ax in drawn["fig"].axes:
        if ax.get_ylabel():
            assert ax.get_ylim()[1] < highest * charts.BUDGET_IN_VIEW_FACTOR / 2**20
    assert charts.budget_in_view(100.0, 120.0) and not charts.budget_in_view(100.0, 1000.0)
