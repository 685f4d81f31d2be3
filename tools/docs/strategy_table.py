"""Regenerate the strategy table of docs/strategies.md from the strategy classes: what each does, where it runs, its
result against the baseline on the CPU and what `python -m bench plan` tries of it, as each class declares them
(`strategies.framework.catalog`). A test fails when the committed table is not this script's.

Usage (from the repository root):

    .venv/bin/python tools/docs/strategy_table.py [--check]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from strategies import STRATEGIES  # noqa: E402
from strategies.framework import catalog  # noqa: E402

DOC = ROOT / "docs" / "strategies.md"
BEGIN = "<!-- strategy table: tools/docs/strategy_table.py writes it from the strategy classes; edit those, then run it -->"
END = "<!-- end of the strategy table -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table() -> str:
    """The markdown table, one row per registered strategy."""
    lines = ["| strategy | what it does | runs in | result against the baseline | `plan` tries |", "|---|---|---|---|---|"]
    for name in catalog.ordered_names():
        cls = STRATEGIES.get(name)
        cells = [f"`{name}`", cls.description, catalog.runs_in(cls), catalog.result(cls), catalog.planner(cls)]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def with_table(text: str) -> str:
    """`text` (the page) with the block between the markers replaced by the current table."""
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    if not rest:
        raise SystemExit(f"{DOC} has no line {BEGIN!r}")
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page's table is not the classes'")
    args = parser.parse_args(argv)
    text = DOC.read_text(encoding="utf-8")
    new = with_table(text)
    if args.check:
        return 0 if new == text else 1
    DOC.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
