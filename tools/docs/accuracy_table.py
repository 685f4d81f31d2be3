"""The anchors' figures from an anchors CSV (`python -m bench anchors`): docs/accuracy.md's summary, table and notes,
and the README's median and largest |error|, each a block that tools/docs/figures.py regenerates.

Usage (from the repository root):

    .venv/bin/python tools/docs/accuracy_table.py          # = tools/docs/figures.py: every block, the newest anchors CSV
    .venv/bin/python tools/docs/accuracy_table.py CSV --out F   # a stand-alone page of one CSV (a run of your own)

The blocks name `results/reference/anchors/anchors-*.csv`: the newest reference CSV there (by name, its UTC time
first) is read, so a new reference run needs only a re-run of this script. Nothing is typed by hand: every figure
comes from the CSV (and the duration line from the CSV's `duration_s`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.analysis.anchors import summary  # noqa: E402

GiB = 2**30


def _gib(value) -> str:
    return "" if pd.isna(value) else f"{value / GiB:.2f}"


def _pct(value) -> str:
    return "" if pd.isna(value) else f"{value:+.1f}%"


def _cell(text) -> str:
    return "" if pd.isna(text) else str(text).replace("|", "/").replace("\n", " ")


def _summary_lines(rows: list[dict]) -> list[str]:
    stats = summary(rows)
    lines = [f"- anchors: {stats['total']}; with a prediction: {stats['predicted']['rows']}; fully modelled: "
             f"{stats['fully_modelled']['rows']}"]
    for name, key in (("every predicted row", "predicted"), ("fully modelled rows", "fully_modelled")):
        s = stats[key]
        if s["rows"]:
            lines.append(f"- {name}: median |error| **{s['median_abs_error_pct']:.1f}%**, largest "
                         f"**{s['max_abs_error_pct']:.1f}%** (`{s['worst']}`), {s['within_15_pct']} of {s['rows']} "
                         "within 15%")
    return lines


def _records(frame: pd.DataFrame) -> list[dict]:
    """The CSV's rows as bench.analysis.anchors.summary reads them (no prediction: error None)."""
    rows = frame.to_dict("records")
    for row in rows:
        row["fully_modelled"] = bool(row["fully_modelled"]) if not pd.isna(row["fully_modelled"]) else False
        row["error_pct"] = None if pd.isna(row["error_pct"]) else float(row["error_pct"])
    return rows


def render_body(frame: pd.DataFrame, csv_name: str) -> str:
    """The summary, the table, then what each row does not model."""
    rows = _records(frame)
    out = [f"Generated from `{csv_name}` by `tools/docs/figures.py`; do not edit by hand.", "", "## Summary", "",
           *_summary_lines(rows),
           "- goal: median |error| <= 5% and every row within 15% over at least 15 rows",
           f"- its predictions took {frame['duration_s'].fillna(0).sum():.0f} s, the anchors' durations summed "
           "(`--jobs` runs several at once)", "",
           "## The table", "",
           "| anchor | source | GPU | kind | published | published GiB | predicted GiB | error | status | membench spec |",
           "| --- | --- | --- | --- | --- | ---: | ---: | ---: | --- | --- |"]
    for row in frame.itertuples():
        spec = row.predicted_spec if not pd.isna(row.predicted_spec) else row.strategy_spec
        out.append(f"| {row.anchor} | [{row.source}]({_link(row.source_ref)}) {_cell(row.label)} | {row.gpu} | "
                   f"{row.published_kind} | {row.published_value:g} {row.published_unit} | "
                   f"{_gib(row.published_bytes)} | {_gib(row.predicted_bytes)} | {_pct(row.error_pct)} | "
                   f"{row.status} | `{_cell(spec)}` |")
    out += ["", "## What each row does not model, and its assumptions", ""]
    for row in frame.itertuples():
        out.append(f"- **{row.anchor}** ({_cell(row.configuration)})")
        if not pd.isna(row.not_modelled) and row.not_modelled:
            out.append(f"  - not modelled: {_cell(row.not_modelled)}")
        if not pd.isna(row.predicted_terms) and row.predicted_terms:
            out.append(f"  - terms: {_cell(row.predicted_terms)}")
        if row.status == "error":
            out.append(f"  - error: {_cell(row.message)}")
    out += ["", "The assumptions of each source are in its anchor file (`bench/anchors/<source>.yaml`) and in the "
                "CSV's `assumptions` column."]
    return "\n".join(out)


def render(frame: pd.DataFrame, csv_name: str) -> str:
    """A stand-alone page of one CSV."""
    return "# Accuracy: membench's CUDA predictions against published GPU measurements\n\n" + \
        render_body(frame, csv_name) + "\n"


def readme_summary(frame: pd.DataFrame, csv_name: str, csv_link: str) -> str:
    """The README's paragraph: what the command predicts, the median and largest |error|, whether the goal is met."""
    rows = _records(frame)
    s = summary(rows)["predicted"]
    statuses = frame["status"].value_counts()
    without = ", ".join(f"{statuses[k]} {k}" for k in ("not_modelled", "error") if k in statuses)
    met = (s["rows"] >= 15 and s["median_abs_error_pct"] <= 5 and s["within_15_pct"] == s["rows"]
           and s["rows"] == len(rows))
    return (f"`python -m bench anchors` (`make anchors`) predicts {len(rows)} figures that others measured on GPUs and "
            f"published ({', '.join(dict.fromkeys(frame['source']))}), each on fake CUDA with that GPU's compute "
            f"capability, against the same kind of figure. In the reference run [`{csv_name}`]({csv_link}), over the "
            f"{s['rows']} rows with a prediction: median |error| **{s['median_abs_error_pct']:.1f}%**, largest "
            f"**{s['max_abs_error_pct']:.1f}%** (`{s['worst']}`), {s['within_15_pct']} of {s['rows']} within 15%"
            + (f"; without a prediction: {without}" if without else "") + ". The goal (median |error| <= 5% and "
            f"every row within 15%, over at least 15 rows) is {'met' if met else 'not met yet'}.")


def _anchors_page(source: Path, page: Path) -> str:
    return render_body(pd.read_csv(source), source.relative_to(ROOT).as_posix())


def _anchors_readme(source: Path, page: Path) -> str:
    relative = source.relative_to(ROOT).as_posix()
    target = relative if page.parent == ROOT else "../" + relative
    return readme_summary(pd.read_csv(source), source.name, target)


def _anchors_rows(source: Path, page: Path) -> str:
    """A short table of one anchors CSV's rows (a partial re-run): published, predicted, error, status."""
    lines = ["| anchor | published GiB | predicted GiB | error | status |", "| --- | ---: | ---: | ---: | --- |"]
    for row in pd.read_csv(source).itertuples():
        status = f"error ({_cell(row.message).removeprefix('error: ')[:80]})" if row.status == "error" else row.status
        lines.append(f"| {row.anchor} | {_gib(row.published_bytes)} | {_gib(row.predicted_bytes)} | "
                     f"{_pct(row.error_pct)} | {status} |")
    return "\n".join(lines)


GENERATORS = {"anchors-page": _anchors_page, "anchors-readme": _anchors_readme, "anchors-rows": _anchors_rows}


def _link(source_ref: str) -> str:
    if source_ref.startswith("http"):
        return source_ref
    where, commit = source_ref.rsplit("@", 1)
    owner, name, path = where.split("/", 2)
    return f"https://github.com/{owner}/{name}/blob/{commit}/{path}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="?", default=None,
                        help="an anchors CSV for a stand-alone page (default: none; regenerate every block)")
    parser.add_argument("--out", default=None, help="the stand-alone page's path (default: standard output)")
    args = parser.parse_args(argv)
    if args.csv is None:
        import figures

        return figures.main([])
    csv = Path(args.csv)
    name = csv.resolve().relative_to(ROOT) if csv.resolve().is_relative_to(ROOT) else csv
    page = render(pd.read_csv(csv), str(name))
    if args.out:
        Path(args.out).write_text(page, encoding="utf-8")
        print(f"wrote {args.out} from {csv}")
    else:
        print(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
