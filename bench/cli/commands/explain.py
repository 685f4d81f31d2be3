"""`explain`: one case's peak memory broken down (weights, gradients, optimizer, activations, ...) module by module
(bench.cli.commands_analysis)."""

from __future__ import annotations

from bench.cli.arguments import DEFAULT_OUT, WORKLOAD_HELP, add_snapshot_option, add_threads_option
from bench.cli.command import Command


def add_arguments(parser) -> None:
    parser.add_argument("--strategy", required=True, help="one strategy spec, e.g. baseline or checkpoint+amp")
    parser.add_argument("--phase", default="train", help="train or eval (default train)")
    parser.add_argument("--batch-size", default=None,
                        help="one batch size (default: the workload's own, see `list`)")
    parser.add_argument("--device", default="cpu", help="cpu, the only choice: the breakdown needs the exact CPU "
                                                        "count (default cpu)")
    parser.add_argument("--data", default=None, help="a data source of the workload (default synthetic where it has "
                                                     "one: memory does not depend on the values)")
    parser.add_argument("--workload", default=None, help=WORKLOAD_HELP)
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"folder for --snapshot's file (default {DEFAULT_OUT}/)")
    add_snapshot_option(parser, "into --out, in explain-<run>.snapshots/")
    add_threads_option(parser)


def run(args) -> int:
    from bench.core.collector import imported_paused

    # torch and the models, imported only when the command runs
    return imported_paused("bench.cli.commands_analysis", "cmd_explain")(args)


COMMAND = Command("explain", "break one case's peak memory down (weights, gradients, optimizer, activations, ...) "
                             "module by module", add_arguments, run)
