"""The help texts name the sharded strategies from the strategies' own declaration (`distributed = True` on a class,
or inherited), read from their source so that `--help` imports no torch: a new sharded strategy appears there, and a
name typed by hand cannot drift from the registry."""

from __future__ import annotations

from bench.cli.arguments import sharded_strategy_names
from bench.cli.main import build_parser
from strategies import STRATEGIES


def _help_of(command: str) -> str:
    parser = build_parser()
    [sub] = [action for action in parser._subparsers._group_actions]
    return " ".join(sub.choices[command].format_help().split())


def test_the_sharded_names_are_those_the_registered_classes_declare():
    declared = sorted(name for name in STRATEGIES.names()
                      if STRATEGIES.get(name).__module__.startswith("strategies.") and STRATEGIES.get(name).distributed)
    assert declared and list(sharded_strategy_names()) == declared


def test_the_ranks_help_of_run_and_predict_names_them():
    names = ", ".join(sharded_strategy_names())
    assert f"for the sharded strategies {names} (gloo" in _help_of("run")
    assert f"for the sharded strategies ({names}):" in _help_of("predict")
