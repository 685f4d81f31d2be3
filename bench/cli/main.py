"""`python -m bench`: builds the parser of every command, dispatches to the command, and turns a usage error or an
interrupt into its one line and exit code.

The CLI parses, checks every value before anything runs (bench.run.preflight), dispatches and prints. Each command
is one module of bench/cli/commands/ that declares its name, its line of `--help`, its options and the function that
runs it together (bench.cli.command.Command); this module only lists them.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from bench.cli import fake_cuda_handover, interrupt
from bench.cli.arguments import DEFAULT_OUT, refuse_blank_values
from bench.cli.command import Command
from bench.cli.commands import anchors, compare, cuda_env, env, explain, fit, list_, plan, predict, report, run
from bench.core.errors import UsageError, shortened
from bench.core.job_environment import check_job_environment
from bench.core.processes import exit_status
from bench.measure.quiet_tracing import quiet_tracing
from bench.measure.resident import pin_mmap_threshold

DESCRIPTION = ("Measures what each PyTorch memory-saving technique saves and costs (peak memory, step time, whether "
               "the result still matches the baseline) on a model you choose, on this machine. Results go to "
               f"{DEFAULT_OUT}/ unless --out says otherwise; `python -m bench <command> --help` for each command.")

# The commands, in the order `--help` lists them. A command's module imports nothing heavy until it runs: `report`
# (drawn on any machine from a copied results folder), `cuda-env`, `--help` and a usage error never import torch.
COMMANDS: tuple[Command, ...] = tuple(module.COMMAND for module in (
    list_, env, run, compare, report, explain, predict, fit, plan, anchors, cuda_env))


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2 (no usage dump)."""

    def error(self, message: str):
        raise UsageError(message)


def command_function(name: str) -> Callable[[argparse.Namespace], int]:
    """The function that runs command `name`."""
    return next(command.run for command in COMMANDS if command.name == name)


def build_parser() -> argparse.ArgumentParser:
    """The parser of `python -m bench` and its commands; `args.command` names the command given."""
    parser = _Parser(prog="python -m bench", description=DESCRIPTION)
    names = ",".join(command.name for command in COMMANDS)
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="{" + names + "}")
    sub.required = True
    for command in COMMANDS:
        description = command.help[0].upper() + command.help[1:] + "."
        command.add_arguments(sub.add_parser(command.name, help=command.help, description=description))
    refuse_blank_values(parser)
    return parser


def main(argv: Sequence[str] | None = None, may_hand_over: bool = False) -> int:
    """Runs one command; exit code 2 for a usage error (one line on stderr), 130 for an interrupt (143 SIGTERM, 129
    SIGHUP). With `may_hand_over` (`python -m bench`, whose process this is), a CUDA prediction whose work would go
    to the fake-CUDA environment's Python replaces this process by that Python first (bench.cli.fake_cuda_handover)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    interrupt.start(argv)
    try:
        pin_mmap_threshold()  # before anything grows the heap (bench.measure.resident)
        args = build_parser().parse_args(argv)  # --help ends here with argparse's SystemExit(0), as it should
        check_job_environment(args.command)
        python = fake_cuda_handover.handover_python(args) if may_hand_over else None
        if python is not None:  # before torch is imported here: that Python imports it once, for everything
            fake_cuda_handover.hand_over(python, argv)
        if may_hand_over:
            fake_cuda_handover.import_plugins_on_arrival()
        quiet_tracing()  # library messages about membench's own hooks, not the answer
        try:
            return command_function(args.command)(args)
        except SystemExit as error:  # no command of ours exits: a user's workload code called sys.exit
            print(f"error: the workload's code called sys.exit({error.code!r}) during `{args.command}`, which "
                  "stopped it there; the workload must return, not exit", file=sys.stderr)
            return 1
    except UsageError as error:
        print(f"error: {shortened(str(error))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stopped:  # Ctrl-C, or SIGTERM/SIGHUP under `python -m bench` (bench/__main__.py)
        print(f"\n{interrupt.note()}", file=sys.stderr)
        return exit_status(stopped)
