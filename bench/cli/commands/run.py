"""`run`: a suite file, or the strategies given with --strategies, measured into a results CSV
(bench.cli.commands_run)."""

from __future__ import annotations

from bench.cli.arguments import add_case_options, add_memory_limit_option
from bench.cli.command import Command


def add_arguments(parser) -> None:
    parser.add_argument("--suite", default=None, help="a suite YAML file, e.g. bench/suites/default.yaml (what `make "
                                                      "bench` runs); default: none, give --strategies")
    parser.add_argument("--strategies", default=None, help="comma list of strategies, e.g. "
                                                           "checkpoint,amp,checkpoint+amp (default: the suite's)")
    add_case_options(parser)
    add_memory_limit_option(parser)


def run(args) -> int:
    from bench.cli.commands_run import cmd_run  # torch and the runner, imported only when the command runs

    return cmd_run(args)


COMMAND = Command("run", "run a suite file, or the strategies given with --strategies, into a results CSV",
                  add_arguments, run)
