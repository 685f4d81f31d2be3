"""`report`: the charts and the run's REPORT.md (and REPORT.html) from results CSVs alone; this module, like
bench.report, never imports torch. Its options are in bench/cli/commands/report.py, whose run function imports
this module (pandas, matplotlib) when it runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from bench.core.errors import UsageError
from bench.core.results import PREDICT, REPORT_COLUMNS, RESULTS, newer_schema_version, read_results_file
from bench.report.data import report_name
from bench.report.html import build_html, is_predict_csv, plotly_bundle
from bench.report.markdown import build_report, newest_csv, parse_size
from bench.run.preflight import check_output_dir


def cmd_report(args) -> int:
    """Draws the charts and `<run>.REPORT.md` from results CSVs alone (default: the newest CSV in results/); with
    --html, `<run>.REPORT.html` too. Each report is named after its CSVs, so no run's report overwrites another's.
    A `predict` CSV gets the HTML page alone (its predictions and predicted snapshots)."""
    try:
        budget = parse_size(args.budget) if args.budget else None
    except ValueError as error:
        raise UsageError(f"bad --budget {args.budget!r}: {error}") from None
    if args.csv:
        paths = [Path(p) for p in args.csv]
    else:
        try:
            paths = [newest_csv(Path(args.results))]
        except FileNotFoundError:
            raise UsageError(f"no results CSV in {args.results!r}; run `python -m bench compare` first, or name "
                             "a CSV (the reference runs are under results/reference/)") from None
    predictions = [p for p in paths if p.is_file() and is_predict_csv(p)]
    if predictions and len(predictions) < len(paths):
        raise UsageError("report either results CSVs or predict CSVs, not both at once: "
                         f"{', '.join(str(p) for p in predictions)} are predictions")
    if predictions and not args.html:
        raise UsageError(f"{predictions[0]} is a `predict` table: `report --html` draws its predictions and predicted "
                         "snapshots; REPORT.md and the PNG charts are drawn from measured runs")
    for path in paths:  # each checked before anything is drawn
        frame = _predict_table(path) if predictions else read_results_file(path, "cannot report on", REPORT_COLUMNS)
        table = PREDICT if predictions else RESULTS
        newer = newer_schema_version(frame, table)
        if newer is not None:
            print(f"warning: {path} was written by a newer membench (schema_version {newer}; this one reads up to "
                  f"{table.version}): columns it added are left out, and a figure whose meaning changed is drawn as "
                  "this version understands it; report it with that version", file=sys.stderr)
    out = check_output_dir(args.out or paths[0].parent, "--out" if args.out else "the results file's folder")
    page = plotly_bundle() if args.html else None  # a missing plotly is said before anything is drawn
    if not predictions:
        print(f"wrote {build_report(paths, out, budget, report_name(paths, '.md'))}")
    if page is not None:
        path, skipped = build_html(paths, out, report_name(paths, ".html"))
        for line in skipped:
            print(line, file=sys.stderr)
        print(f"wrote {path}")
    return 0


def _predict_table(path: Path) -> pd.DataFrame:
    """A predict CSV's rows, or a UsageError of one line where pandas cannot read them."""
    try:
        return pd.read_csv(path)
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as error:
        raise UsageError(f"cannot report on {str(path)!r}: not a readable CSV ({str(error).splitlines()[0]})") from None
