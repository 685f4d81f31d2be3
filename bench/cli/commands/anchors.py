"""`anchors`: every published GPU measurement of bench/anchors/ predicted on fake CUDA, with the error of each
(bench.cli.commands_anchors)."""

from __future__ import annotations

from bench.cli.arguments import DEFAULT_OUT, positive_int
from bench.cli.command import Command


def add_arguments(parser) -> None:
    parser.add_argument("--only", default=None, help="comma list of anchor or source names, e.g. torchao or "
                                                    "transformers-vanilla (default: every anchor)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"folder for anchors-<run>.csv (default {DEFAULT_OUT}/)")
    parser.add_argument("--jobs", type=positive_int, default=1,
                        help="anchors predicted at once, each in its own fake-CUDA process (their figures do not "
                             "depend on it; each process needs up to 2 GB resident) (default 1)")


def run(args) -> int:
    from bench.cli.commands_anchors import cmd_anchors  # the predictor, imported only when the command runs

    return cmd_anchors(args)


COMMAND = Command("anchors", "predict every published GPU measurement of bench/anchors/ on fake CUDA and print each "
                             "error", add_arguments, run)
