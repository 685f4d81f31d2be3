"""`compare`: the baseline and each named strategy, measured, printed as a table relative to the baseline and
written as a results CSV (bench.cli.commands_run)."""

from __future__ import annotations

from bench.cli.arguments import add_case_options, add_memory_limit_option
from bench.cli.command import Command


def add_arguments(parser) -> None:
    parser.add_argument("--strategies", required=True, help="comma list, e.g. checkpoint,amp (baseline is always "
                                                            "run)")
    add_case_options(parser)
    add_memory_limit_option(parser)


def run(args) -> int:
    from bench.cli.commands_run import cmd_compare  # torch and the runner, imported only when the command runs

    return cmd_compare(args)


COMMAND = Command("compare", "run the baseline and each named strategy, print a table relative to the baseline, "
                             "write the CSV", add_arguments, run)
