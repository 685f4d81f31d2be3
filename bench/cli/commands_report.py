"""`report`: the charts and REPORT.md from results CSVs alone; this module, like bench.report, never imports torch."""

from __future__ import annotations

from pathlib import Path

from bench.core.errors import UsageError
from bench.core.results import REPORT_COLUMNS, read_results_file
from bench.report.html import build_html, plotly_bundle
from bench.report.markdown import build_report, newest_csv, parse_size
from bench.run.preflight import check_output_dir


def cmd_report(args) -> int:
    """Draws the charts and REPORT.md from results CSVs alone (default: the newest CSV in results/)."""
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
    for path in paths:
        read_results_file(path, "cannot report on", REPORT_COLUMNS)  # every file checked before anything is drawn
    out = check_output_dir(args.out or paths[0].parent, "--out" if args.out else "the results file's folder")
    page = plotly_bundle() if args.html else None  # a missing plotly is said before anything is drawn
    report = build_report(paths, out, budget)
    print(f"wrote {report}")
    if page is not None:
        print(f"wrote {build_html(paths, out)}")
    return 0
