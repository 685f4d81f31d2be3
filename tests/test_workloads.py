"""Every registered workload x every registered strategy: verified against that workload's baseline, or a visible
`unsupported` row with its reason; the exact CPU tracker against PyTorch's MemTracker on every workload.

Workloads run at the small size their class declares (`small`) so that the whole grid stays within seconds; what
each strategy gives on each workload (matches, differs by design and why, unsupported and why) is declared on the
strategy's class (`expected`, and `expected_with` per trait of the workload's model, `Workload.traits()`).
tests/conformance.py holds the checks.
"""

from __future__ import annotations


import pytest
import torch

import conformance
from bench.core.errors import UsageError
from bench.run.case import Case
from bench.run.runner import run_case
from strategies import STRATEGIES, Strategy
from workloads import WORKLOADS, Workload, get_workload, workload_names
from workloads.framework.loader import resolve_workload


def _grid():
    for workload in workload_names():
        for strategy in STRATEGIES.names():
            for phase in ("train", "eval"):
                yield pytest.param(workload, strategy, phase, id=f"{workload}-{strategy}-{phase}")


@pytest.mark.parametrize("name", workload_names())
def test_a_workload_declares_its_defaults_and_small_size(name):
    conformance.check_workload_declarations(name)


@pytest.mark.parametrize("workload,strategy,phase", list(_grid()))
def test_strategy_on_workload_matches_or_says_why(workload, strategy, phase):
    conformance.check_strategy_on_workload(workload, strategy, phase)


@pytest.mark.parametrize("workload", workload_names())
def test_checkpoint_lowers_the_train_peak(workload):
    conformance.check_checkpoint_lowers_the_train_peak(workload)


# --- dropout: verification sees the random state -------------------------------------------------------

def test_dropout_masks_repeat_and_checkpoint_recomputes_them(temporary_strategy):
    """gpt_mini has dropout: the same seed gives the same masks (checkpoint matches, its recompute replaying the
    random state), and a strategy that shifts the random stream before the forward is caught."""
    @temporary_strategy
    class DrawsRandom(Strategy):
        name = "test_draws_random"

        def forward(self):
            torch.rand(1)  # moves the global generator: every dropout mask changes
            return super().forward()

    spec, batch = WORKLOADS.get("gpt_mini").small
    assert get_workload(spec).settings["dropout"] > 0
    ok = run_case(Case(spec, "checkpoint:segments=2", "train", batch, "cpu", data="synthetic", warmup=0, steps=1))
    assert ok["status"] == "ok" and ok["matches_baseline"] is True and ok["loss_rel_diff"] == 0.0, ok
    shifted = run_case(Case(spec, "test_draws_random", "train", batch, "cpu", data="synthetic", warmup=0, steps=1))
    assert shifted["status"] == "ok" and shifted["matches_baseline"] is False, shifted


# --- naming a workload ------------------------------------------------------------------------------------

def test_options_are_parsed_recorded_and_checked():
    workload = resolve_workload("deep_mlp:layers=7:width=3")
    assert workload.settings == {"layers": 7, "width": 3} and workload.spec() == "deep_mlp:layers=7:width=3"
    assert resolve_workload("deep_mlp:width=10").spec() == "deep_mlp"  # defaults are left out of the spec
    row = run_case(Case("deep_mlp:layers=7:width=3", "baseline", "train", 2, "cpu", warmup=0, steps=1), env={})
    assert row["workload"] == "deep_mlp:layers=7:width=3" and row["workload_settings"] == "layers=7;width=3"
    for bad, words in [("deep_mlp:depth=3", "unknown option of workload 'deep_mlp'"),
                       ("deep_mlp:layers=many", "bad value 'many' for deep_mlp:layers"),
                       ("deep_mlp:layers=0", "deep_mlp:layers=0 must be at least 1"),
                       ("deep_mlp:layers", "expected deep_mlp:option=value")]:
        with pytest.raises(UsageError, match=words):
            resolve_workload(bad)


USER_FILE = '''
import torch
from torch import nn
from workloads import Workload


class Tiny(Workload):
    """A user's own two-layer model."""
    default_batch_size = 4
    options = {"hidden": 8}

    def build_model(self):
        return nn.Sequential(nn.Linear(3, self.settings["hidden"]), nn.ReLU(), nn.Linear(self.settings["hidden"], 2))

    def make_batch(self, batch_size, data="synthetic"):
        gen = torch.Generator().manual_seed(self.seed)
        return {"input": torch.rand(batch_size, 3, generator=gen)}, torch.rand(batch_size, 2, generator=gen)

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)


def make_tiny():
    return Tiny(hidden=5)


NOT_A_WORKLOAD = 3
'''


def test_user_workload_from_a_file_with_dict_inputs(tmp_path, monkeypatch):
    path = tmp_path / "mine.py"
    path.write_text(USER_FILE)
    monkeypatch.chdir(tmp_path)
    workload = resolve_workload("mine.py:Tiny:hidden=6")
    assert workload.spec() == "mine.py:Tiny:hidden=6" and workload.settings == {"hidden": 6}
    assert resolve_workload("mine.py:make_tiny").settings == {"hidden": 5}  # a function returning one
    for strategy in ("checkpoint", "inplace_relu"):
        row = run_case(Case("mine.py:Tiny", strategy, "train", 4, "cpu", warmup=0, steps=1), env={})
        assert row["status"] == "ok" and row["matches_baseline"] is True, row


@pytest.mark.parametrize("spec,words", [
    ("nope.py:x", "workload file 'nope.py' does not exist"),
    ("mine.py:Missing", "'mine.py' has no 'Missing'"),
    ("mine.py:NOT_A_WORKLOAD", "not a Workload subclass or a function"),
    ("mine.py", "names no object"),
    ("no_such_package.module:Thing", "workload module 'no_such_package.module' not found"),
    ("nonsense", "unknown workload 'nonsense'; valid choices: captcha_resnet18"),
])
def test_bad_workload_references_are_one_line_errors(tmp_path, monkeypatch, spec, words):
    (tmp_path / "mine.py").write_text(USER_FILE)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=words) as caught:
        resolve_workload(spec)
    assert "\n" not in str(caught.value)


def test_entry_point_workloads_are_registered(monkeypatch):
    import importlib.metadata

    from workloads.framework import loader

    class Plugged(Workload):
        name = "plugged_in"

    class FakeEntryPoint:
        name, value = "plugged_in", "somepackage.workloads:Plugged"

        def load(self):
            return Plugged

    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: [FakeEntryPoint()] if group == loader.ENTRY_POINT_GROUP else [])
    loader.load_entry_points.cache_clear()
    try:
        assert "plugged_in" in workload_names()
        assert isinstance(resolve_workload("plugged_in"), Plugged)
    finally:
        WORKLOADS.unregister("plugged_in")
        loader.load_entry_points.cache_clear()


def test_unknown_data_source_names_the_workload_and_its_choices():
    with pytest.raises(UsageError, match=r"unknown data source 'captcha' for workload 'deep_mlp'; valid choices: "
                                         r"synthetic"):
        get_workload("deep_mlp").check_data("captcha")
