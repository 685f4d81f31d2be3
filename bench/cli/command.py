"""What a command of `python -m bench` is: its name, its line of `--help`, the options it takes and the function that
runs it, declared together in the command's own module under bench/cli/commands/ (as pyperf keeps each subcommand's
parser beside its function); bench.cli.main only collects them.

A command's module imports nothing heavy at its top: `--help`, a usage error, `report` and `cuda-env` never import
torch, so `run` imports what the command needs (torch, the models, pandas) when it runs, as pyperf's `cmd_*` do.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Command:
    """One command: `python -m bench <name>`, listed in `--help` with `help`, its options added to its parser by
    `add_arguments`, run by `run(args)`, which returns the exit code."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
