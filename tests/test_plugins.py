"""A technique is one file: a new strategy module, or a new workload module, dropped into its package's folder is
discovered, registered and passes every registry-wide check (tests/conformance.py) with no other file changed.

The new module is written into a temporary folder added to the package's `__path__` (what a file in strategies/
or workloads/ is to the package), found by the same discovery that `import strategies` runs, and removed from the
registry and `sys.modules` afterwards, so no other test sees it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import conformance
from bench.core.registry import import_modules_of
from strategies import PHASES, STRATEGIES
from workloads import WORKLOADS, workload_names

NEW_STRATEGY = '''"""Validation under torch.inference_mode(): no autograd graph, and no version counters either."""

import torch

from strategies import Strategy, register_strategy


@register_strategy
class InferenceModeEval(Strategy):
    """The forward of validation under `torch.inference_mode()` (the stricter `no_grad`)."""

    name = "inference_mode_eval"
    description = "validation under torch.inference_mode()"
    phases = ("eval",)
    # Eval on captcha_resnet18 at batch 8: weights plus one layer's transients, as no_grad_eval
    memory_effect = {"eval": (0.3, 0.5)}

    def forward(self):
        return torch.inference_mode()
'''

NEW_WORKLOAD = '''"""A deep narrow MLP of tanh layers regressing random targets: many small activations, nothing else."""

import torch
from torch import nn

from workloads import Workload, register_workload


@register_workload
class TanhMLP(Workload):
    """`layers` Linear+Tanh pairs of `width` features, MSE loss on synthetic data."""

    name = "tanh_mlp"
    description = "a deep MLP of Linear+Tanh layers on random data"
    default_batch_size = 16
    options = {"layers": 12, "width": 8}
    small = ("tanh_mlp", 8)
    small_for = {"loop": ("tanh_mlp", 64), "peak_in_backward": ("tanh_mlp", 64)}

    def configure(self):
        self.require_positive("layers", "width")

    def build_model(self):
        width = self.settings["width"]
        return nn.Sequential(*[m for _ in range(self.settings["layers"]) for m in (nn.Linear(width, width), nn.Tanh())])

    def make_batch(self, batch_size, data="synthetic"):
        generator = torch.Generator().manual_seed(self.seed)
        width = self.settings["width"]
        return (torch.randn(batch_size, width, generator=generator),
                torch.randn(batch_size, width, generator=generator))

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)
'''


@pytest.fixture
def drop_in(monkeypatch, tmp_path):
    """`drop_in(package, module, source, registry)`: writes `source` as `package.module` into a folder of the
    package, runs the package's discovery, and returns the names it registered (removed when the test ends)."""
    registered = []

    def drop(package, module, source, registry):
        folder = tmp_path / package
        folder.mkdir()
        (folder / f"{module}.py").write_text(source, encoding="utf-8")
        monkeypatch.setattr(sys.modules[package], "__path__", [*sys.modules[package].__path__, str(folder)])
        before = set(registry.names())
        discovered = import_modules_of(package)
        added = [name for name in registry.names() if name not in before]
        registered.extend((registry, name) for name in added)
        assert f"{package}.{module}" in discovered
        return added

    yield drop
    for registry, name in registered:
        registry.unregister(name)
    for name in [m for m in sys.modules if m.startswith(("strategies.inference_mode_eval", "workloads.tanh_mlp"))]:
        del sys.modules[name]
    conformance.measured.cache_clear()


def test_a_new_strategy_is_one_file(drop_in):
    """The new strategy is registered, declares what the registry-wide tests need, is in their parametrization,
    and passes each kind of their checks (on captcha_resnet18, and on a workload of the grid): its memory band is
    checked by tests/test_strategies.py's parametrized test like any other (a pass at batch 8 is ~5 s here)."""
    name = "inference_mode_eval"
    assert drop_in("strategies", name, NEW_STRATEGY, STRATEGIES) == [name]
    conformance.check_strategy_declarations(name)
    assert conformance.strategy_cases("supported", [name]) == [(name, "eval")]
    assert conformance.strategy_cases("unsupported", [name]) == [(name, "train")]
    assert conformance.strategy_cases("memory", [name]) == [(name, "eval")]
    conformance.check_matches_baseline(name, "eval")
    conformance.check_unsupported_row(name, "train")
    for phase in PHASES:
        conformance.check_strategy_on_workload("deep_mlp", name, phase)


@pytest.mark.slow  # in .ci/run's long tests of make test
def test_a_new_workload_is_one_file(drop_in):
    """The new workload is registered, declares what the registry-wide tests need, and passes each kind of their
    checks: the grid (a strategy that matches, one that differs by design, one the model gives nothing to do, a
    phase a strategy does not run in), the literal loop's peak and the fake 16-bit count. No strategy names it:
    each gives its declared default there."""
    name = "tanh_mlp"
    assert drop_in("workloads", name, NEW_WORKLOAD, WORKLOADS) == [name]
    assert name in workload_names()
    conformance.check_workload_declarations(name)
    assert not conformance.small_traits(name)  # Linear+Tanh: no trait any strategy states another outcome for
    assert not [s for s in STRATEGIES.names()
                if conformance.expected_on(s, name) != STRATEGIES.get(s).expected]
    for strategy, phase in [("baseline", "train"), ("baseline", "eval"), ("checkpoint", "train"),
                            ("bf16_weights", "eval"), ("inplace_relu", "train"), ("no_grad_eval", "train")]:
        conformance.check_strategy_on_workload(name, strategy, phase)
    conformance.check_train_peak_is_the_literal_loops(name)
    conformance.check_fake_16bit_count(name)


def test_the_docs_strategy_table_is_the_classes():
    """docs/strategies.md's table is what tools/docs/strategy_table.py writes from the registered classes (run it after
    changing a strategy)."""
    path = Path(__file__).resolve().parent.parent / "tools" / "docs" / "strategy_table.py"
    spec = importlib.util.spec_from_file_location("strategy_table", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    text = tool.DOC.read_text(encoding="utf-8")
    assert tool.with_table(text) == text, "the strategy table of docs/strategies.md is stale: run tools/docs/strategy_table.py"
    assert all(f"| `{name}` |" in text for name in STRATEGIES.names())


@pytest.mark.parametrize("package, registry", [("strategies", STRATEGIES), ("workloads", WORKLOADS)])
def test_the_folder_lists_plug_ins_only(package, registry):
    """Every module at the top of strategies/ and workloads/ registers a plug-in: the API, the spec resolution and
    the helpers several plug-ins share are in the package's `framework` subpackage, which discovery leaves out, so
    the folder a plug-in author opens lists plug-ins (and a plug-in imports the API from the package itself)."""
    folder = Path(sys.modules[package].__file__).parent
    top_level = {f"{package}.{path.stem}" for path in folder.glob("*.py") if path.name != "__init__.py"}
    registering = {registry.get(name).__module__ for name in registry.names()}
    assert not top_level - registering, f"these register nothing; framework/ is their place: {top_level - registering}"
    discovered = import_modules_of(package)
    assert top_level <= set(discovered)
    assert not [name for name in discovered if name.startswith(f"{package}.framework")]
    assert all(hasattr(sys.modules[package], name) for name in sys.modules[package].__all__)
