"""`list`: the registered workloads and strategies, with their options (bench.cli.commands_run)."""

from __future__ import annotations

from bench.cli.command import Command


def add_arguments(parser) -> None:
    """`list` takes no options."""


def run(args) -> int:
    from bench.cli.commands_run import cmd_list  # the registries: torch, imported only when the command runs

    return cmd_list(args)


COMMAND = Command("list", "list the workloads and strategies, with their options", add_arguments, run)
