"""Regenerate every figure block of README.md and docs/*.md from the committed results file it names, or check them.

A block that shows results sits between two markers, the first naming its generator and its source:

    <!-- figures:models-train source=results/reference/models/20261124T013326Z-cpu-7aa5.csv -->
    ...generated markdown, never edited by hand...
    <!-- /figures -->

A source with a `*` is a pattern inside one folder: the newest match (by name, the run id's UTC time first) is read,
so that a new reference run (say `results/reference/anchors/anchors-<time>-cuda-<id>.csv`) updates every block that
names the pattern when this script is re-run. Usage (from the repository root):

    .venv/bin/python tools/docs/figures.py            # rewrite every block in place
    .venv/bin/python tools/docs/figures.py --check    # exit 1 and name each block that differs from its source

tests/test_docs_figures.py runs the check, so a figure that disagrees with its results file fails the suite.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "docs"))

BLOCK = re.compile(r"(?P<open><!-- figures:(?P<name>[\w-]+) source=(?P<source>\S+) -->\n)(?P<body>.*?)"
                   r"(?P<close><!-- /figures -->)", re.S)


def pages() -> list[Path]:
    """Every page whose blocks are generated: README.md and docs/*.md."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def resolve(source: str) -> Path:
    """The file (or folder of files) a marker names: the path itself, or the newest match of a `*` pattern in one
    folder."""
    if "*" not in source:
        path = ROOT / source
        if not path.exists():
            raise FileNotFoundError(f"no results file {source}")
        return path
    matches = sorted((ROOT / source).parent.glob(Path(source).name))
    if not matches:
        raise FileNotFoundError(f"no results file matches {source}")
    return matches[-1]


def render_page(text: str, page: Path) -> tuple[str, list[str]]:
    """`text` with every block regenerated, and the names of the blocks whose text changed."""
    changed = []

    def replace(match):
        name, source = match["name"], match["source"]
        if name not in GENERATORS:
            raise KeyError(f"{page.relative_to(ROOT)}: unknown figures block {name!r} (known: {sorted(GENERATORS)})")
        try:
            path = resolve(source)
        except FileNotFoundError as missing:
            raise FileNotFoundError(f"{page.relative_to(ROOT)}: block {name}: {missing}") from None
        body = GENERATORS[name](path, page).rstrip("\n") + "\n"
        if body != match["body"]:
            changed.append(f"{name} (source={source})")
        return match["open"] + body + match["close"]

    return BLOCK.sub(replace, text), changed


def drifted() -> list[str]:
    """One line per block whose text differs from what its source generates now: page, block and source."""
    found = []
    for page in pages():
        _, changed = render_page(page.read_text(encoding="utf-8"), page)
        found += [f"{page.relative_to(ROOT)}: {block}" for block in changed]
    return found


def blocks() -> list[tuple[Path, str, str]]:
    """(page, block name, source) of every block."""
    return [(page, m["name"], m["source"]) for page in pages()
            for m in BLOCK.finditer(page.read_text(encoding="utf-8"))]


import accuracy_table  # noqa: E402  (the anchors' blocks: one logic for docs/accuracy.md and the README)
import figure_blocks  # noqa: E402  (the other reference runs' blocks)
from figure_blocks import read_rows  # noqa: E402,F401  (the tests read CSVs with it)

GENERATORS = {**figure_blocks.GENERATORS, **accuracy_table.GENERATORS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 naming each drifted block")
    args = parser.parse_args(argv)
    if args.check:
        found = drifted()
        for line in found:
            print(f"differs from its source: {line}")
        return 1 if found else 0
    for page in pages():
        text = page.read_text(encoding="utf-8")
        new, changed = render_page(text, page)
        if changed:
            page.write_text(new, encoding="utf-8")
            print(f"{page.relative_to(ROOT)}: rewrote {', '.join(changed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
