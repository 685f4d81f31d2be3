"""`report`: the charts and REPORT.md (and REPORT.html) from results CSVs alone, on any machine: no torch
(bench.cli.commands_report)."""

from __future__ import annotations

from bench.cli.arguments import DEFAULT_OUT
from bench.cli.command import Command


def add_arguments(parser) -> None:
    parser.add_argument("csv", nargs="*", help="results CSV files (default: the newest in --results)")
    parser.add_argument("--results", default=DEFAULT_OUT,
                        help=f"where to look for the newest CSV (default {DEFAULT_OUT}/)")
    parser.add_argument("--out", default=None,
                        help="where to write the charts and REPORT.md (default: the CSV's folder)")
    parser.add_argument("--budget", default=None, help="a memory budget line for the batch-size chart, e.g. 4GiB "
                                                       "(default: none)")
    parser.add_argument("--html", action="store_true",
                        help="also write REPORT.html beside REPORT.md: one self-contained page (no network) with the "
                             "sortable table, interactive charts and the memory timeline of each case with a "
                             "snapshot (needs plotly: pip install membench[report]) (default off)")


def run(args) -> int:
    from bench.cli.commands_report import cmd_report  # pandas and matplotlib, imported only when the command runs

    return cmd_report(args)


COMMAND = Command("report", "draw the charts and REPORT.md from results CSVs alone (no torch needed)",
                  add_arguments, run)
