"""The floor of a plan combination (`bench.analysis.plan_floor`) on fake CUDA: every strategy that declares that it
keeps the baseline's training state, the CUDA-only ones included, peaks at least at the baseline's parameters and
optimizer state in a CUDA step (tests/test_plan_floor.py checks the others on the CPU's exact tracker)."""

from __future__ import annotations

import pytest

from bench.analysis import plan_floor
from bench.analysis.fake_engine import tracked_step
from bench.core.errors import Unsupported
from bench.run.case import Case, bind_case
from tests.test_plan_floor import BATCH, HEAVY_STATE, HEAVY_STATE_CNN, keeping_strategies

from .conftest import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")


@pytest.mark.parametrize("spec", keeping_strategies(("cuda",)))
def test_a_strategy_that_keeps_the_training_state_peaks_above_the_floor_on_cuda(spec):
    if not bind_case(Case(HEAVY_STATE, spec, "train", BATCH, "cuda"), 1)[0].keeps_training_state:
        pytest.skip(f"{spec} does not declare that it keeps the baseline's training state")
    for workload in (HEAVY_STATE, HEAVY_STATE_CNN):  # the CNN for the strategies of BatchNorm or ReLU layers
        try:
            step = tracked_step(Case(workload, spec, "train", BATCH, "cuda", data="synthetic"), spec, "fake-cuda")
        except Unsupported:
            continue
        assert step.peak_bytes >= plan_floor.training_state_bytes(workload)
        return
    pytest.fail(f"{spec} ran on neither {HEAVY_STATE} nor {HEAVY_STATE_CNN}")
