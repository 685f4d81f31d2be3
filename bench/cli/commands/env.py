"""`env`: the environment every results row records (bench.cli.commands_run)."""

from __future__ import annotations

from bench.cli.command import Command


def add_arguments(parser) -> None:
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")


def run(args) -> int:
    from bench.cli.commands_run import cmd_env  # torch, imported only when the command runs

    return cmd_env(args)


COMMAND = Command("env", "show the environment every results row records (device, torch, CPU threads, commit)",
                  add_arguments, run)
