"""Every measured figure in README.md and docs/*.md is generated from, or links to, the committed file it is read
from, so that a reader can check it and a new run cannot leave it stale unnoticed.

The rule, as this test applies it:

- A *figure* is a number with a unit of memory (B, bytes, KiB, MiB, GiB, KB, MB, GB), of time (ms, s, min, h), a
  ratio written against the number (`0.59×`, `1.00x`) or a percentage; and every number in a row of a markdown table
  whose cells hold numbers. Numbers in code spans and fenced code (commands, option values such as `r=8` or
  `--target-ci 0.1`), in HTML comments and in headings are not figures, nor are version numbers, dates, counts and
  section numbers, which carry none of those units.
- A figure is *accounted for* when it lies inside a generated block (`<!-- figures:NAME source=... -->` ...
  `<!-- /figures -->`, written by tools/docs/figures.py and checked by tests/test_docs_figures.py; or the strategy
  table tools/docs/strategy_table.py writes), or when the unit it stands in links to the committed file or folder it
  is read from: a link to `results/...` or to another committed data file (`.csv`, `.json`, `.txt`, `.log`), or a
  committed test file it names (`tests/....py`) that asserts the figure; the file must exist. The unit is the
  paragraph, the list item (with its continuation lines) or the table row; a table row is also
  accounted for by a link in the table's caption, the paragraph right before the table.
- A section whose paragraph opens with `*Not reproduced:*` (with its subsections), or a unit that says its figures
  are not reproduced, declares figures typed from commands whose results files were not committed
  (docs/reference-results.md lists them): they are reported, not failed.
- Settings, goals, specifications and figures quoted from others' publications that carry a unit are named, page by
  page and by their words, in NOT_MEASURED_HERE (a statistic's 95% interval, a dtype's bytes and a card's size as
  sold are left out by NOT_FIGURES for every page).
- A figure that is none of these fails, with its page and line.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Settings, goals and specifications a page states with a unit, and figures it quotes from a publication named beside
# them (not measured here), each by its exact words
NOT_MEASURED_HERE = {
    "README.md": ["a 1 GiB budget"],
    "docs/cli.md": ["within 5 s"],
    "docs/workloads.md": ["15% of positions masked"],
    "docs/plan.md": ["5% kept free", "counted as 500 MiB", "781 MB without CUDA's lazy module loading",
                     "about 300-500 MiB with it", "at least 1% of memory or 0.5% of time",
                 "a 32 MiB copy"],
    "docs/python-api.md": ["within 0.5% of the fastest"],
    "docs/prediction.md": ["the CUDA context (500 MiB)"],
    "docs/peers.md": ["4x the float32 size for", "2x for", "roughly 4x the model for Adam and up to 20% more",
                      "rounded up to 512 bytes"],
    "docs/testing.md": ["(0 ms between two)", "80 GiB)"],
    "docs/timing.md": ["keeps this at 95% or more", "= 96.9%", "at most 10 s of them"],
    "docs/measuring.md": ["resident at most 1.3x the counted peak", "(1.3x its baseline's", "(4 MiB pieces",
                          "2-4x the model", "over 231 bytes", "the limit is 255 bytes", "2x params",
                          "(x2 in training)"],
}

FIGURE = re.compile(
    r"(?<![\w.])[-−+]?\d[\d,]*(?:\.\d+)?(?:e-?\d+)?"
    r"(?:\s?(?:bytes|KiB|MiB|GiB|KB|MB|GB|ms|s|min|h)(?![\w/])|\sB(?![\w/])|%|[×x](?![\w]))")
# Quantities that are definitions, settings or specifications, not measurements: the statistics' confidence level,
# a dtype's or a formula's bytes (a size of at most 64 bytes), a card's memory as sold, a default or a limit named as
# such, and 2^30; blanked before the figures are looked for
NOT_FIGURES = re.compile(
    r"95%\s+(?:confidence\s+)?interval|\b(?:[1-9]|[1-5]\d|6[0-4])[ -](?:bytes?|B)\b|\b\d+ GB (?:card|GTX|GPU)"
    r"|\b(?:a|an|its|the) \d+ GB\b|default(?: is)? [\d.]+\s?(?:s|%|MiB|GiB)\b|\b2\^\d+ bytes")
SOURCE_LINK = re.compile(r"\]\(((?:\.\./)?(?:results/[^)]*|[^)]+\.(?:csv|json|txt|log)))\)")
TEST_FILE = re.compile(r"\b(tests(?:_cuda_fake)?/[\w/]+\.py)\b")
GENERATED = re.compile(r"<!-- figures:[\w-]+ source=\S+ -->.*?<!-- /figures -->"
                       r"|<!-- strategy table:.*?<!-- end of the strategy table -->", re.S)
FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
COMMENT = re.compile(r"<!--.*?-->", re.S)
CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)


def pages() -> list[str]:
    return ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]


def _blank(match: re.Match) -> str:
    """The matched text with every character but newlines made a space: lines keep their numbers."""
    return re.sub(r"[^\n]", " ", match.group(0))


def _units(text: str, raw: str) -> list[tuple[int, str, str]]:
    """(first line number, kind, text) of each paragraph, list item and table row of `text` (a page with its code,
    comments and generated blocks blanked; `raw`, the same lines with their code spans, says where they break);
    a table row's text is followed by its caption's."""
    units: list[tuple[int, str, str]] = []
    current: list[str] = []
    start = last_line = 0  # where the unit being read starts; the last line of the last paragraph or item
    caption, in_table = "", False

    def close():
        nonlocal current, last_line
        if current:
            units.append((start, "paragraph", "\n".join(current)))
            last_line = start + len(current) - 1
        current = []

    for number, (line, shown) in enumerate(zip(text.split("\n"), raw.split("\n")), 1):
        stripped = shown.strip()
        if stripped.startswith("|"):
            close()
            if not in_table:  # a table's first row: its caption is the paragraph right before it, if any
                caption = units[-1][2] if units and units[-1][1] == "paragraph" and last_line >= number - 2 else ""
            in_table = True
            units.append((number, "table row", line + "\n" + caption))
            continue
        in_table = False
        if not stripped or stripped.startswith("#"):
            close()
            continue
        if re.match(r"(?:[-*+]|\d+\.)\s", stripped):
            close()  # a list item is a unit of its own
        if not current:
            start = number
        current.append(line)
    close()
    return units


NUMERIC_CELL = re.compile(r"[-+−]?\d[\d,.]*(?:e-?\d+)?\s?(?:[×x%]|bytes|B|KiB|MiB|GiB|KB|MB|GB|ms|s|min)?"
                          r"(?:\s*(?:/|->|→|-|–|\+)\s*[-+−]?\d[\d,.]*\s?(?:[×x%]|B|MiB|GiB)?)*")


def _cells_hold_numbers(row: str) -> bool:
    """Whether a table row has a cell (after the first) that is a number, with its unit, a ratio or a pair, once its
    parenthesised remarks and emphasis are left out: a row of figures, not of words that start with a digit."""
    cells = [re.sub(r"\(.*?\)", "", c).strip(" *~") for c in row.split("\n")[0].strip().strip("|").split("|")]
    return any(NUMERIC_CELL.fullmatch(c) for c in cells[1:] if c)


def _sources(raw: str) -> list[str]:
    """The committed files a unit's text names as its source: links to results/ or to a data file, and test files
    (a link or a code span: tests/....py, tests_cuda_fake/....py) that assert the figures; each must exist."""
    named = [m.group(1) for m in SOURCE_LINK.finditer(raw)] + TEST_FILE.findall(raw)
    return [n for n in named if (ROOT / n.removeprefix("../").split("#")[0]).exists()]


def unaccounted(page: str, not_reproduced: bool = False) -> list[str]:
    """`page:line: text` of each unit holding a figure that is neither generated nor linked to its source, outside
    the sections that declare their figures not reproduced (with `not_reproduced`: inside them)."""
    raw = (ROOT / page).read_text(encoding="utf-8")
    for pattern in (GENERATED, FENCE, COMMENT):
        raw = pattern.sub(_blank, raw)
    scan = NOT_FIGURES.sub(_blank, CODE.sub(_blank, raw))
    for words in NOT_MEASURED_HERE.get(page, []):
        assert words in scan, f"{page}: NOT_MEASURED_HERE names {words!r}, which the page no longer says"
        scan = scan.replace(words, " " * len(words))
    raw_lines = raw.split("\n")
    declared = _declared_not_reproduced(raw_lines)
    found = []
    for line, kind, unit in _units(scan, raw):
        own = unit.split("\n")[0] if kind == "table row" else unit
        figures = [m.group(0) for m in FIGURE.finditer(own)]
        if not figures and kind == "table row" and _cells_hold_numbers(own):
            figures = [own]
        if not figures:
            continue
        if kind == "table row":
            source_text = raw_lines[line - 1] + "\n" + "\n".join(_caption_of(raw_lines, line))
        else:
            source_text = "\n".join(raw_lines[line - 1:line - 1 + own.count("\n") + 1])
        here = line in declared or re.search(r"\bnot reproduced\b", source_text, re.I) is not None
        if not _sources(source_text) and here == not_reproduced:
            shown = ", ".join(figures) if kind != "table row" else ""
            found.append(f"{page}:{line}: [{shown}] {' '.join(own.split())[:160]}")
    return found


def _declared_not_reproduced(lines: list[str]) -> set[int]:
    """The line numbers (1-based) inside a section, with its subsections, that opens a paragraph with
    `*Not reproduced:*`: the page's own declaration that the section's figures come from commands whose results
    files were not committed (docs/reference-results.md lists them)."""
    declared, stack = set(), []  # stack: [heading level, declared] of the sections the line is in
    for number, line in enumerate(lines, 1):
        heading = re.match(r"(#+)\s", line)
        if heading:
            while stack and stack[-1][0] >= len(heading.group(1)):
                stack.pop()
            stack.append([len(heading.group(1)), False])
        elif line.startswith("*Not reproduced:*") and stack:
            stack[-1][1] = True
        if any(flag for _, flag in stack):
            declared.add(number)
    return declared


def _caption_of(lines: list[str], row: int) -> list[str]:
    """The paragraph right before the table that holds line `row` (1-based), blank line or not, else nothing."""
    i = row - 1
    while i > 0 and lines[i - 1].strip().startswith("|"):
        i -= 1
    i -= 1  # the line before the table's first row
    if i >= 0 and not lines[i].strip():
        i -= 1
    caption = []
    while i >= 0 and lines[i].strip() and not lines[i].strip().startswith(("|", "#")):
        caption.insert(0, lines[i])
        if re.match(r"\s*(?:[-*+]|\d+\.)\s", lines[i]):
            break
        i -= 1
    return caption


@pytest.mark.parametrize("page", pages())
def test_every_figure_is_generated_or_links_its_source(page):
    found = unaccounted(page)
    declared = unaccounted(page, not_reproduced=True)
    if declared:
        print(f"{page}: {len(declared)} units of figures in sections declared not reproduced:\n" + "\n".join(declared))
    assert not found, (
        f"{len(found)} units of figures in {page} neither in a generated block nor linked to the committed file they "
        "are read from: link the file, or generate them (docs/reference-results.md):\n" + "\n".join(found))


def test_a_figure_without_its_source_is_found_and_a_linked_or_generated_one_is_not(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    for source in ("results/reference/models/x.csv", "results/a.csv", "results/reference/x.csv"):
        (tmp_path / source).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / source).write_text("a\n")
    (tmp_path / "page.md").write_text(
        "The peak was 305.0 MiB at batch 25.\n\n"
        "The peak was 305.0 MiB ([the run](results/reference/models/x.csv)).\n\n"
        "Run `fit --budget 1GiB` with `r=8`, torch 2.13.0, on 2026-11-27, item 47 of section 3.\n\n"
        "<!-- figures:models-train source=results/reference/models/x.csv -->\n| a | 1.00× |\n<!-- /figures -->\n\n"
        "```\npeak 12 MiB\n```\n\n"
        "- a list item: 0.59× the baseline\n  continued\n- another, linked: 0.60× ([csv](../results/a.csv))\n\n"
        "Caption, from [the CSV](results/reference/x.csv):\n\n| strategy | peak |\n|---|---:|\n| baseline | 737.0 |\n\n"
        "A table without its source:\n\n| strategy | peak |\n|---|---:|\n| baseline | 737.0 |\n\n"
        "A link to a file that is not there: 1.5 GiB ([csv](results/none.csv)).\n",
        encoding="utf-8")
    found = unaccounted("page.md")
    assert [f.split(": ", 1)[1].split("] ", 1)[1][:22] for f in found] == [
        "The peak was 305.0 MiB", "- a list item: 0.59× t", "| baseline | 737.0 |", "A link to a file that "], found
