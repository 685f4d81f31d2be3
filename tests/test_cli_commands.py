"""Where a command lives: each module of bench/cli/commands/ declares one command (its name, help line, options and
run function, `COMMAND`) and bench.cli.main lists every one of them; and because a command module imports nothing heavy
at its top, `--help`, every command's `--help`, a usage error, `report` and `cuda-env` refusing a value import no
torch (nor the registries, which import it)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.cli import main as cli_main
from bench.cli.command import Command

ROOT = Path(__file__).resolve().parent.parent
COMMANDS_DIR = ROOT / "bench" / "cli" / "commands"


def test_every_command_module_is_listed_once_and_declares_its_own_command():
    modules = sorted(path.stem for path in COMMANDS_DIR.glob("*.py") if path.stem != "__init__")
    declared = [importlib.import_module(f"bench.cli.commands.{name}").COMMAND for name in modules]
    assert all(isinstance(command, Command) for command in declared)
    assert sorted(c.name for c in cli_main.COMMANDS) == sorted(c.name for c in declared)  # none missing from the list
    assert len({c.name for c in cli_main.COMMANDS}) == len(cli_main.COMMANDS)
    for command in declared:  # the run function sits in the module that declares the command
        assert command.run.__module__ == command.add_arguments.__module__, command.name
    subparsers = next(a for a in cli_main.build_parser()._actions if a.choices and a.dest == "command").choices
    assert list(subparsers) == [c.name for c in cli_main.COMMANDS]


LIGHT = """
import contextlib, io, json, sys
from bench.cli.main import COMMANDS, main
calls = [["--help"], *([c.name, "--help"] for c in COMMANDS), ["predict", "--no-such-option"],
         ["report", "/no/such/results.csv"], ["cuda-env", "--path", "/no/such/env", "--torch-version", "latest"]]
codes = []
for argv in calls:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            codes.append(main(argv))
        except SystemExit as done:
            codes.append(done.code)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "strategies", "workloads"))
print(json.dumps({"codes": codes, "heavy": heavy}))
"""


def test_help_usage_errors_report_and_cuda_env_import_no_torch():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", LIGHT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["codes"] == [0] * (1 + len(cli_main.COMMANDS)) + [2, 2, 2], done.stderr
    assert seen["heavy"] == [], "imported on the light path"
