"""The figures README.md and docs/*.md show from results are the committed results files' own: tools/docs/figures.py
regenerates every marked block in memory and any difference fails, naming the page, the block and its source."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    sys.path.insert(0, str(ROOT / "tools" / "docs"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "docs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


figures = _load("figures")


def test_every_figure_block_equals_what_its_results_file_generates():
    drifted = figures.drifted()
    assert not drifted, ("figures differ from their results files (run .venv/bin/python tools/docs/figures.py):\n"
                         + "\n".join(drifted))


def test_every_block_names_a_known_generator_and_a_committed_results_file():
    found = figures.blocks()
    names = {name for _, name, _ in found}
    assert {"models-train", "anchors-readme", "anchors-page", "llm-measured"} <= names
    for page, name, source in found:
        assert name in figures.GENERATORS, (page.name, name)
        assert source.startswith("results/reference/"), (page.name, name, source)
        assert figures.resolve(source).exists()
    readme = [(name, source) for page, name, source in found if page.name == "README.md"]
    assert ("anchors-readme", "results/reference/anchors/anchors-*.csv") in readme


def test_a_figure_edited_by_hand_is_caught_with_its_block_and_page():
    page = ROOT / "README.md"
    text = page.read_text(encoding="utf-8")
    assert "<!-- figures:models-train" in text
    start = text.index("<!-- figures:models-train")
    body = text[start:text.index("<!-- /figures -->", start)]
    number = next(word for word in body.split() if word.replace(".", "").isdigit() and "." in word)
    edited = text[:start] + body.replace(number, f"{float(number) + 0.1:.1f}", 1) + text[start + len(body):]
    _, changed = figures.render_page(edited, page)
    assert changed and changed[0].startswith("models-train (source=results/reference/models/")
    assert figures.render_page(text, page)[1] == []


def test_the_newest_anchors_csv_is_the_one_read(tmp_path, monkeypatch):
    """A new reference run (a later UTC time in its name) replaces the older one in every anchors block."""
    folder = tmp_path / "results" / "reference" / "anchors"
    folder.mkdir(parents=True)
    old = figures.resolve("results/reference/anchors/anchors-*.csv")
    shutil.copy(old, folder / "anchors-20000101T000000Z-cuda-old.csv")
    newer = folder / "anchors-29991231T000000Z-cuda-new.csv"
    shutil.copy(old, newer)
    monkeypatch.setattr(figures, "ROOT", tmp_path)
    assert figures.resolve("results/reference/anchors/anchors-*.csv") == newer
    with pytest.raises(FileNotFoundError, match="no results file"):
        figures.resolve("results/reference/none-*.csv")


def test_a_run_that_contradicts_the_words_around_its_figures_fails(tmp_path):
    """The README's bullets say, in words, what the models run shows; a run where in-place ReLU saved memory would
    make "saves nothing" false, and the block refuses to render rather than print it."""
    import csv

    source = figures.resolve("results/reference/models/20261124T013326Z-cpu-7aa5.csv")
    rows = figures.read_rows(source)
    for row in rows:
        if row["strategy"] == "inplace_relu" and row["phase"] == "train" and row["status"] == "ok":
            row["mem_vs_baseline"] = "0.9"
    changed = tmp_path / source.name
    with changed.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    assert "saves nothing" in figures.GENERATORS["models-findings"](source, figures.ROOT / "README.md")
    with pytest.raises(ValueError, match="in-place ReLU saves nothing"):
        figures.GENERATORS["models-findings"](changed, figures.ROOT / "README.md")
