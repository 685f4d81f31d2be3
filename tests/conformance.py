"""The registry-wide checks of one strategy or one workload, read from what its class declares
(`strategies.Strategy`: `expected`, `expected_with`, `memory_effect`, `refusals`, `test_spec`, `plan_options`;
`workloads.Workload`: `small`, `small_for`, `requires`, and the traits of its model, `traits()`). The tests
parametrized over the registries and the proof that a new plug-in is one file (tests/test_plugins.py) call these same
functions.

Strategies are checked on captcha_resnet18 (verified at batch 4, or 2 under bf16 autocast, which this CPU runs
~8x slower than fp32; memory bands at batch 8, where the train peak falls in backward) and on every workload at
its `small` size; memory figures come from the exact live-tensor tracker.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
import warnings

import pytest
import torch

from bench.run.fake_pass import fake_memory_pass
from bench.run.case import Case, bind_case, seed_everything
from bench.run.runner import memory_pass, run_case, verify
from bench.run.passes import MEMORY_WARMUP_STEPS
from strategies import PHASES, STRATEGIES, Expected, Strategy, StrategySpec
from workloads import WORKLOADS, Trait, get_workload

WORKLOAD = "captcha_resnet18"  # the workload a strategy's own expectations (`memory_effect`, its phases) are of
BATCH = 8      # memory comparisons: the train peak falls in backward, where activations count
VERIFY_BATCH = 4  # correctness against the baseline needs no large batch
AMP_BATCH = 2  # correctness of bf16 autocast, which costs ~20 s a step at batch 8 on this CPU
OUTCOMES = ("matches", "differs", "unsupported")
PURPOSES = ("loop", "emulated16", "peak_in_backward", "fake_cuda")  # the keys of `Workload.small_for`


def spec_for_tests(name: str) -> str:
    """The spec the tests run strategy `name` as (its `test_spec`, where its defaults are too slow for them)."""
    return STRATEGIES.get(name).test_spec or name


# --- what a plug-in declares ----------------------------------------------------------------------------------

def check_strategy_declarations(name: str) -> None:
    """Strategy `name` declares its expectations in a form the checks can use, and every setting the planner may
    try of it (`plan_settings`, on the CPU and CUDA, one rank and two) is a valid spec of it."""
    from bench.analysis.plan_candidates import excluded_strategies
    from strategies import PlanSpace

    cls = STRATEGIES.get(name)
    assert set(cls.phases) <= set(PHASES), cls.phases
    for trait, expected in [(None, cls.expected), *cls.expected_with.items()]:
        assert isinstance(expected, Expected) and expected.outcome in OUTCOMES, (name, trait, expected)
        assert expected.outcome == "matches" or expected.why, f"{name}: say why it {expected.outcome} with {trait}"
    assert not set(cls.expected_with) - {trait.value for trait in Trait}, f"{name}: expected_with names no Trait"
    assert set(cls.memory_effect) <= set(captcha_phases(name)), f"{name}: memory_effect of a phase it cannot run"
    assert all(0 < low <= high for low, high in cls.memory_effect.values()), cls.memory_effect
    for pattern in cls.refusals:
        re.compile(pattern)
    assert StrategySpec(spec_for_tests(name)).parsed().members[0][0] is cls
    assert not (cls.plan_excluded and "plan_options" in vars(cls)), f"{name}: declares options and an exclusion"
    if name in excluded_strategies():
        return
    for device in ("cpu", "cuda"):
        for ranks in (1, 2):
            context = bind_case(Case(WORKLOAD, "baseline", "train", 2, device), ranks)[1]
            for options in cls.plan_settings(PlanSpace(context, 100 * 2**20)):
                spec = cls(**options).spec()
                assert StrategySpec(spec).build().spec() == spec


def check_workload_declarations(name: str) -> None:
    """Workload `name` declares its defaults and a small size for the tests, each naming itself."""
    cls = WORKLOADS.get(name)
    assert cls.description and cls.default_batch_size > 0 and cls.data_sources, name
    assert cls.small is not None, f"{name}: declare `small`, the (spec, batch) the registry-wide tests run it at"
    assert not set(cls.small_for) - set(PURPOSES), f"{name}: small_for keys are {PURPOSES}"
    assert all(isinstance(trait, Trait) for trait in cls.declared_traits), f"{name}: declared_traits are Traits"
    for purpose in (None, *PURPOSES):
        size = cls.small_case(purpose)
        if size is None:
            continue
        spec, batch = size
        assert spec.split(":")[0] == name and batch > 0, (name, purpose, size)
        if cls.requires is None or importlib.util.find_spec(cls.requires) is not None:
            get_workload(spec)  # its options parse


def small_traits(workload: str) -> frozenset[str]:
    """The traits of workload `workload`'s model at the size the registry-wide tests run it at (`small`)."""
    return get_workload(WORKLOADS.get(workload).small_case()[0]).traits()


def expected_on(strategy: str, workload: str) -> Expected:
    """What strategy `strategy` declares of its row on workload `workload` at its `small` size, by its traits."""
    return STRATEGIES.get(strategy).expected_outcome(small_traits(workload))


def skip_without_requirement(workload: str) -> None:
    """Skips the test where the package workload `workload` requires is absent or cannot be imported here."""
    package = WORKLOADS.get(workload).requires
    if package is None:
        return
    try:
        importlib.import_module(package)
    except Exception as error:  # noqa: BLE001 - timm fails with RuntimeError on a torchvision of another torch
        pytest.skip(f"{package} cannot be imported here: {type(error).__name__}: {error}".splitlines()[0])


# --- a strategy on captcha_resnet18 ----------------------------------------------------------------------------

def captcha_phases(name: str) -> tuple[str, ...]:
    """The phases strategy `name` runs in on the CPU on captcha_resnet18 (none where it is unsupported there)."""
    cls = STRATEGIES.get(name)
    return () if expected_on(name, WORKLOAD).outcome == "unsupported" else cls.cpu_phases()


def strategy_cases(kind: str, names: list[str] | None = None) -> list[tuple[str, str]]:
    """(strategy, phase) on captcha_resnet18: those it runs in ("supported"), those it is refused in
    ("unsupported"), those whose peak ratio it declares ("memory")."""
    cases = []
    for name in names if names is not None else STRATEGIES.names():
        for phase in PHASES:
            supported = phase in captcha_phases(name)
            if (kind == "supported" and supported or kind == "unsupported" and not supported
                    or kind == "memory" and phase in STRATEGIES.get(name).memory_effect):
                cases.append((name, phase))
    return cases


def captcha_case(spec: str, phase: str, batch: int = BATCH, **kw) -> Case:
    return Case(WORKLOAD, spec, phase, batch, "cpu", data="synthetic", warmup=0, steps=1, **kw)


def bound(spec: str, phase: str) -> Strategy:
    strategy, context = bind_case(captcha_case(spec, phase))
    strategy.check(context)
    return strategy


def verified(spec: str, phase: str, batch: int | None = None) -> dict:
    batch = batch or (AMP_BATCH if "amp" in spec else VERIFY_BATCH)
    return verify(captcha_case(spec, phase, batch), bound(spec, phase))


@functools.lru_cache(maxsize=None)
def measured(spec: str, phase: str, batch: int = BATCH) -> dict:
    return memory_pass(captcha_case(spec, phase, batch), bound(spec, phase))


def peak(spec: str, phase: str, batch: int = BATCH) -> int:
    return measured(spec, phase, batch)["peak_mem_bytes"]


def peak_16bit_on_fake_tensors(spec: str, phase: str, batch: int = BATCH) -> int:
    """The peak of a 16-bit `spec` as membench counts it where this CPU emulates 16-bit arithmetic, on fake tensors
    (equal to the real step's, tests/test_emulated16.py), whatever this CPU: a real bfloat16 step at batch 8 took
    20-90 s on CPUs without native bfloat16, well under a second on those with it."""
    return fake_memory_pass(captcha_case(spec, phase, batch), bound(spec, phase))["peak_mem_bytes"]


def check_matches_baseline(name: str, phase: str) -> None:
    """Verified against the baseline on captcha_resnet18: the same result, or a difference it declares (and why)."""
    expected = expected_on(name, WORKLOAD)
    result = verified(spec_for_tests(name), phase)
    assert result["params_without_grad"] == 0
    assert result["matches_baseline"] is (expected.outcome == "matches"), result
    if expected.outcome == "matches":
        assert result["bn_stats_match"] is True and "message" not in result, result
    else:
        assert "does not match the baseline by design" in result["message"], result
        assert expected.why in result["message"], result


def check_unsupported_row(name: str, phase: str) -> None:
    """A phase it does not run in on captcha_resnet18 is an `unsupported` row that says why."""
    cls = STRATEGIES.get(name)
    row = run_case(captcha_case(spec_for_tests(name), phase), env={})
    assert row["status"] == "unsupported", row
    if "cuda" in cls.devices and "cpu" not in cls.devices:
        assert "cuda" in row["message"]
    else:
        assert phase in row["message"]
    expected = expected_on(name, WORKLOAD)
    if expected.outcome == "unsupported":
        assert expected.why in row["message"], row


def check_memory_band(name: str, phase: str) -> None:
    """Its peak over the baseline's on captcha_resnet18 at batch 8 is within the band it declares."""
    low, high = STRATEGIES.get(name).memory_effect[phase]
    ratio = peak(name, phase) / peak("baseline", phase)
    assert low <= ratio <= high, f"{name} {phase}: peak ratio {ratio:.3f} outside [{low}, {high}]"


# --- a strategy on a workload ----------------------------------------------------------------------------------

def small_case(workload: str, strategy: str, phase: str, purpose: str | None = None) -> Case:
    spec, batch = WORKLOADS.get(workload).small_case(purpose)
    return Case(spec, strategy, phase, batch, "cpu", data="synthetic", warmup=0, steps=1)


def check_strategy_on_workload(workload: str, strategy: str, phase: str) -> None:
    """Strategy on workload at its small size: the outcome the strategy declares for it (matches the baseline,
    differs by design and why, or unsupported and why), or an unsupported row in a phase it does not run in."""
    skip_without_requirement(workload)
    cls = STRATEGIES.get(strategy)
    expected = expected_on(strategy, workload)
    row = run_case(small_case(workload, spec_for_tests(strategy), phase), env={})
    if expected.outcome == "unsupported":
        assert row["status"] == "unsupported" and expected.why in row["message"], row
    elif phase not in cls.cpu_phases():
        assert row["status"] == "unsupported", row
        assert any(word in row["message"] for word in (phase, "cuda", "--ranks")), row
    elif expected.outcome == "differs":
        assert row["status"] == "ok", row["message"]
        assert row["matches_baseline"] is False and expected.why in row["message"], row
    else:
        assert row["status"] == "ok", row["message"]
        assert row["matches_baseline"] is True, row
        assert row["params_without_grad"] == 0 and row["bn_stats_match"] is True, row
        assert row["peak_mem_bytes"] > 0, row
        # a steady loop gives back every step's memory; summing the loss with autograd on (eval) never does
        grows = (strategy, phase) == ("pitfall_loss_sum", "eval")
        assert (row["mem_growth_bytes_per_step"] > 0) is grows, row
    assert row["workload"] == get_workload(WORKLOADS.get(workload).small_case()[0]).spec()


def check_checkpoint_lowers_the_train_peak(workload: str) -> None:
    """Checkpointing lowers the workload's train peak at a batch whose peak falls in backward."""
    skip_without_requirement(workload)
    peaks = {}
    for strategy in ("baseline", "checkpoint"):
        case = small_case(workload, strategy, "train", "peak_in_backward")
        peaks[strategy] = memory_pass(case, bind_case(case)[0])["peak_mem_bytes"]
    assert peaks["checkpoint"] < peaks["baseline"], peaks


# --- a workload's baseline against the literal loop, and its 16-bit count on fake tensors --------------------

MEASURED_STEP = MEMORY_WARMUP_STEPS["cpu"] + 1  # membench's measured step is the one after its warm-up steps


def literal_loop_peak(spec: str, batch: int, phase: str, steps: int, prepare=None) -> int:
    """The peak bytes of the last of `steps` iterations of the literal loop, counted by PyTorch's MemTracker;
    `prepare(model)` is what the user's script does to the model before the optimizer is made (a library's
    checkpointing switch). See tests/test_loop_lifetimes.py."""
    mem_tracker = importlib.import_module("torch.distributed._tools.mem_tracker")
    workload = get_workload(spec)
    seed_everything(workload.seed)  # as Session: the weights, then the batch, then the steps' random state
    model = workload.build_model()
    if prepare is not None:
        prepare(model)
    optimizer = workload.make_optimizer(model)
    x, y = workload.make_batch(batch, "synthetic")
    model.train(phase == "train")
    seed_everything(workload.seed + 1)
    tracker = mem_tracker.MemTracker()
    tracker.track_external(model, optimizer, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MemTracker warns about module hooks it skips
        for _ in range(steps):
            tracker.reset_mod_stats()  # it refuses a module's second forward otherwise
            with tracker:  # entering restarts the peak from what is live: the peak is this iteration's
                pred = workload.run_model(model, x)  # model(x), model(*x) or model(**x)
                if phase == "train":
                    loss = workload.loss(pred, y)
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def membench_peak(spec: str, batch: int, phase: str, strategy: str = "baseline") -> int:
    case = Case(spec, strategy, phase, batch, "cpu", data="synthetic", warmup=0, steps=1)
    return memory_pass(case, bind_case(case)[0])["peak_mem_bytes"]


def check_train_peak_is_the_literal_loops(workload: str) -> None:
    """The baseline's train peak is the literal training loop's, to the byte."""
    skip_without_requirement(workload)
    spec, batch = WORKLOADS.get(workload).small_case("loop")
    assert membench_peak(spec, batch, "train") == literal_loop_peak(spec, batch, "train", MEASURED_STEP)


def check_fake_16bit_count(workload: str) -> None:
    """Fake tensors count a 16-bit autocast step as the CPU does, to the byte (the emulated path's memory)."""
    skip_without_requirement(workload)
    spec, batch = WORKLOADS.get(workload).small_case("emulated16")
    case = Case(spec, "amp", "train", batch, "cpu", data="synthetic", warmup=0, steps=1)
    real = memory_pass(case, bind_case(case)[0])
    fake = fake_memory_pass(case, bind_case(case)[0])
    assert fake["peak_mem_bytes"] == real["peak_mem_bytes"]
    assert fake["peak_stage"] == real["peak_stage"]
    assert fake["mem_growth_bytes_per_step"] == real["mem_growth_bytes_per_step"]
