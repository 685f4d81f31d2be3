"""A new BatchNorm+ReLU CNN workload is one file: tests/fixtures/bn_relu_cnn.py, dropped into workloads/ and found by
its discovery, passes the whole registry grid (every strategy, train and eval) and every per-workload check that the
built-in workloads get (tests/conformance.py), with no strategy naming it: each strategy's outcome on it follows from
the traits its modules show (`Workload.traits()`), as on captcha_resnet18 and unet.

The module is copied into a temporary folder added to the package's `__path__` (what a file in workloads/ is to the
package), and removed from the registry and `sys.modules` when this file's tests end.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

import conformance
from bench.core.registry import import_modules_of
from strategies import PHASES, STRATEGIES
from workloads import WORKLOADS, workload_names

NAME = "bn_relu_cnn"
SOURCE = Path(__file__).resolve().parent / "fixtures" / f"{NAME}.py"
# the strategies that name what a BatchNorm+ReLU CNN is (`expected_with`), with the trait that decides each
BY_TRAIT = {"bn_act_recompute": "batch_norm", "inplace_abn": "batch_norm", "grad_accumulation": "batch_norm",
            "inplace_relu": "relu_like"}


@pytest.fixture(scope="module", autouse=True)
def new_workload(tmp_path_factory):
    """The fixture's module as `workloads.bn_relu_cnn`, registered for this file's tests only."""
    folder = tmp_path_factory.mktemp("workloads")
    shutil.copy(SOURCE, folder / SOURCE.name)
    package = sys.modules["workloads"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(package, "__path__", [*package.__path__, str(folder)])
        before = set(WORKLOADS.names())
        assert f"workloads.{NAME}" in import_modules_of("workloads")
        assert set(WORKLOADS.names()) - before == {NAME}
        yield
        WORKLOADS.unregister(NAME)
        sys.modules.pop(f"workloads.{NAME}", None)


def test_it_is_registered_and_declares_what_the_tests_need():
    assert NAME in workload_names()
    conformance.check_workload_declarations(NAME)


def test_its_traits_come_from_its_modules():
    """Its model shows BatchNorm, ReLU computed out of place and convolutions; the BatchNorm and ReLU strategies
    therefore expect of it what they expect of the built-in CNNs, and not their default."""
    assert conformance.small_traits(NAME) == {"batch_norm", "relu_like", "convolutional"}
    for strategy, trait in BY_TRAIT.items():
        cls = STRATEGIES.get(strategy)
        assert conformance.expected_on(strategy, NAME) == cls.expected_with[trait] != cls.expected, strategy
        assert conformance.expected_on(strategy, NAME) == conformance.expected_on(strategy, "captcha_resnet18")


@pytest.mark.parametrize("strategy,phase", [pytest.param(strategy, phase, id=f"{strategy}-{phase}")
                                            for strategy in STRATEGIES.names() for phase in PHASES])
def test_strategy_on_it_matches_or_says_why(strategy, phase):
    conformance.check_strategy_on_workload(NAME, strategy, phase)


def test_checkpoint_lowers_its_train_peak():
    conformance.check_checkpoint_lowers_the_train_peak(NAME)


def test_its_train_peak_is_the_literal_loops():
    conformance.check_train_peak_is_the_literal_loops(NAME)


def test_its_fake_16bit_count_is_the_cpus():
    conformance.check_fake_16bit_count(NAME)


def test_the_relu_like_trait_is_what_inplace_relu_switches():
    """The trait reads the activations with an `inplace` switch from torch; in-place ReLU lists the ones it switches:
    the same classes, so the trait names what the strategy finds."""
    from strategies.inplace_relu import RELU_LIKE
    from workloads.framework.base import IN_PLACE_ACTIVATIONS

    assert set(IN_PLACE_ACTIVATIONS) == set(RELU_LIKE)
