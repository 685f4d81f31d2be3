"""The floor of a plan combination that keeps the baseline's training state (`bench.analysis.plan_floor`): counted on
the meta device as a real step holds it, declared truthfully by every strategy that declares it (over the registry),
and a combination it rules out does not fit when traced to the end."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.analysis import plan, plan_cost, plan_floor, plan_search, plan_step
from bench.analysis.fake_engine import tracked_step
from bench.cli import commands_plan
from bench.core import gpus
from bench.core.errors import Unsupported
from bench.run.case import Case, bind_case
from strategies import STRATEGIES, StrategySpec
from tests.conformance import spec_for_tests
from workloads import get_workload

# wide and short: the parameters and AdamW's moments (12 bytes a parameter) are most of a step's peak, so a strategy
# that held less of them than the baseline would peak under the floor (the control below shows three that do)
HEAVY_STATE = "gpt_mini:layers=2:width=128:heads=2:seq_len=8:dropout=0.0"


def _real_state_bytes(workload_spec: str) -> int:
    """The parameters and the optimizer's state after one real step on the CPU, each tensor's bytes."""
    workload = get_workload(workload_spec)
    model = workload.build_model()
    optimizer = workload.make_optimizer(model)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    state = [v for values in optimizer.state.values() for v in values.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]  # not the step counts: host scalars on a GPU
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *state])


@pytest.mark.parametrize("workload", [HEAVY_STATE, "captcha_resnet18"])
def test_the_floor_counted_on_meta_is_what_a_real_step_holds(workload):
    floor = plan_floor.training_state_bytes(workload)
    assert floor == _real_state_bytes(workload)
    parameters = sum(p.numel() for p in get_workload(workload).build_model().parameters())
    assert floor == 12 * parameters  # float32 weights and Adam's two float32 moments


def test_a_full_size_models_floor_is_counted_without_allocating_it():
    floor = plan_floor.training_state_bytes("hf:llama-3.1-8b:seq_len=4096")
    assert floor == 12 * 8_030_261_248  # its 8.03e9 parameters, 96 GB, on a machine of 23 GiB


# the ResNet of the articles at batch 1 for the strategies of BatchNorm and ReLU, which the GPT has not: its 11M
# parameters and Adam's moments are most of its peak too
HEAVY_STATE_CNN = "captcha_resnet18"


BATCH = 2  # two samples: grad_accumulation splits them


def _keeps(spec: str, workload: str = HEAVY_STATE) -> bool:
    return bind_case(Case(workload, spec, "train", BATCH, "cpu"), 1)[0].keeps_training_state


def _train_peak(spec: str, workload: str = HEAVY_STATE) -> int:
    return tracked_step(Case(workload, spec, "train", BATCH, "cpu"), spec, "cpu", cuda_autocast=False).peak_bytes


def keeping_strategies(devices: tuple[str, ...]) -> list[str]:
    """The registered strategies whose training step runs on one of `devices` in one process (their test specs)."""
    return [spec_for_tests(name) for name in STRATEGIES.names()
            if not STRATEGIES.get(name).distributed and "train" in STRATEGIES.get(name).phases
            and set(STRATEGIES.get(name).devices) & set(devices)]


@pytest.mark.parametrize("spec", keeping_strategies(("cpu",)))
def test_a_strategy_that_keeps_the_training_state_peaks_above_the_floor(spec):
    """What the floor rests on, for every strategy that declares it: its step's peak is at least the baseline's
    parameters and optimizer state (exact live-tensor bytes on the CPU; the CUDA-only ones are checked on fake CUDA
    in tests_cuda_fake/test_plan_floor_fake_cuda.py)."""
    if not _keeps(spec):
        pytest.skip(f"{spec} does not declare that it keeps the baseline's training state")
    for workload in (HEAVY_STATE, HEAVY_STATE_CNN):  # the CNN for the strategies of BatchNorm or ReLU layers
        try:
            peak = _train_peak(spec, workload)
        except Unsupported:
            continue
        assert peak >= plan_floor.training_state_bytes(workload)
        return
    pytest.fail(f"{spec} ran on neither {HEAVY_STATE} nor {HEAVY_STATE_CNN}")


@pytest.mark.parametrize("spec", ["bf16_weights", "optimizer:name=sgd"])
def test_a_strategy_that_changes_the_training_state_says_so_and_can_peak_under_the_floor(spec):
    """The control: on this workload a strategy holding less than the baseline's state peaks under the floor, so the
    test above fails for one that declared wrongly."""
    assert not _keeps(spec)
    assert _train_peak(spec) < plan_floor.training_state_bytes(HEAVY_STATE)


def test_a_combination_keeps_the_state_when_every_member_does():
    assert StrategySpec("checkpoint+amp:dtype=bfloat16+optimizer:impl=fused").build().keeps_training_state
    assert not StrategySpec("checkpoint+optimizer:name=sgd").build().keeps_training_state
    assert not StrategySpec("checkpoint+lora").build().keeps_training_state


def test_another_optimizer_differs_by_design_once_bound_before_any_step():
    """A plan's replayed candidate is bound and never wraps an optimizer: its row still says that SGD changes the
    update (it once said nothing, and `plan` chose an SGD combination as its answer without --allow-different)."""
    bound = bind_case(Case("hf:llama-3.1-8b:seq_len=4096", "checkpoint+optimizer:name=sgd", "train", 1, "cuda"), 1)[0]
    assert bound.differs_by_design() == "SGD replaces the workload's AdamW: another update of the weights"
    assert bind_case(Case(HEAVY_STATE, "optimizer:impl=foreach", "train", 1, "cpu"), 1)[0].differs_by_design() is None


FIGURES = plan_cost.gpu_figures(gpus.find_gpu("H100 80GB"))
FEW = ("checkpoint", "amp:dtype=bfloat16", "grad_accumulation")
ACTIVATIONS = "gpt_mini:layers=2:width=64:heads=2:seq_len=128"  # checkpoint and amp each save memory: they combine


def _few_settings(monkeypatch) -> None:
    from tests.test_plan import _few_settings  # here: tests_cuda_fake imports this module, where test_plan cannot be

    _few_settings(monkeypatch, FEW)


def _request(limit_bytes: int, allow_different: bool = True) -> plan.PlanRequest:
    """With `allow_different` (a setting that changes what is trained may combine) the settings alone are traced for
    their ratios: without it and with no such setting, none may make a combination that fits."""
    return plan.PlanRequest(ACTIVATIONS, "synthetic", 8, "cuda", "H100 80GB", limit_bytes, 0,
                            plan_cost.to_json(FIGURES), capability=(9, 0), max_search_s=600,
                            allow_different=allow_different)


def test_a_combination_the_floor_rules_out_does_not_fit_traced_to_the_end(monkeypatch):
    _few_settings(monkeypatch)
    floor = plan_floor.training_state_bytes(ACTIVATIONS)
    request = _request(floor - 1)
    lines = []
    searched = plan_search.search(request, lines.append)
    floored = [r for r in searched.rows if plan_floor.stopped_by_floor(r)]
    # a progress line counts what is left to trace: no line for a candidate ruled out, none counted as left
    assert len(lines) == searched.tried and "no known candidates left" in lines[-1]
    assert floored and all(r["members"] >= 2 and not r["fits"] for r in floored)
    assert searched.tried <= len(searched.rows) - len(floored)  # not counted against --max-candidates: no trace
    said = commands_plan._nothing_fits(request, searched, "plan.csv")
    assert f"{len(floored)} combinations hold the baseline's parameters and optimizer state (" in said
    assert "not traced" in said and "--allow-different" in said and "--max-ranks" in said
    for row in floored:
        traced = plan.evaluate(request, row["strategy"], row["members"], FIGURES)
        assert traced["judged_bytes"] > request.limit_bytes, row["strategy"]
    # the rows the floor left are those of a search without it
    monkeypatch.setattr(plan_floor, "training_state_bytes", lambda workload: None)
    without = {r["strategy"]: r for r in plan_search.search(request).rows}
    for row in searched.rows:
        if not plan_floor.stopped_by_floor(row):
            assert dict(row) == dict(without[row["strategy"]]), row["strategy"]
    # every combination the search without it tried, and none else (each of their members keeps the state)
    assert {r["strategy"] for r in floored} == {spec for spec, row in without.items() if row["members"] >= 2}


def test_the_floor_cuts_no_combination_that_may_fit():
    floor = plan_floor.training_state_bytes(ACTIVATIONS)
    request = _request(floor)  # the floor alone fits: every candidate is traced
    assert plan_floor.floor_row(request, "checkpoint+amp:dtype=bfloat16", 2, floor) is None
    over = dataclasses.replace(request, limit_bytes=floor - 1)
    assert plan_step.stopped_over_limit(plan_floor.floor_row(over, "checkpoint+amp:dtype=bfloat16", 2, floor))
    assert plan_floor.floor_row(over, "checkpoint", 1, floor) is None  # a setting alone is traced: its ratios
    assert plan_floor.floor_row(over, "checkpoint+optimizer:name=sgd", 2, floor) is None


def test_where_no_setting_may_combine_to_fit_the_settings_alone_are_ruled_out_too(monkeypatch):
    """Every setting keeps the state and none that does not may combine (no --allow-different): no ratio of a setting
    alone can make a combination that fits, so each is ruled out untraced, and none combines; each traced to the end
    is over the limit. With a setting that may combine (bf16_weights, --allow-different), they are traced."""
    _few_settings(monkeypatch)
    floor = plan_floor.training_state_bytes(ACTIVATIONS)
    request = _request(floor - 1, allow_different=False)
    assert not plan_floor.ratios_may_combine(request, list(FEW))
    assert plan_floor.ratios_may_combine(request, [*FEW, "bf16_weights"]) is False  # it changes what is trained
    assert plan_floor.ratios_may_combine(dataclasses.replace(request, allow_different=True), list(FEW))
    assert plan_floor.ratios_may_combine(dataclasses.replace(request, feeds_ranks=True), list(FEW))
    searched = plan_search.search(request)
    by_spec = {r["strategy"]: r for r in searched.rows}
    ok = {spec for spec, row in by_spec.items() if row["status"] == "ok"}  # not the settings the case refuses
    assert ok == {"baseline", *FEW} and searched.tried == 1  # the baseline alone ran
    for spec in FEW:
        assert plan_floor.stopped_by_floor(by_spec[spec]) and by_spec[spec]["members"] == 1
        assert plan.evaluate(request, spec, 1, FIGURES)["judged_bytes"] > request.limit_bytes, spec
    said = commands_plan._nothing_fits(request, searched, "plan.csv")
    assert "3 candidates (3 settings alone, whose combinations cannot fit either) hold the baseline's" in said
