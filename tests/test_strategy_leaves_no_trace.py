"""A strategy's step that stops inside a module (a plan candidate once over its limit raises there, and so does an
error) leaves the process as it found it: torch's functions, its tensors' and modules' methods, the global module
hooks and the process-wide flags are those it had. A plan worker runs one candidate after another in one process,
and a strategy that left its own `F.linear` in place changed every later candidate's prediction (zero3 did:
strategies/framework/deepspeed_zero3.py). Over the whole registry, each on a small GPT on the CPU."""

from __future__ import annotations

import contextlib

import pytest
import torch

from bench.analysis.fake_engine import tracked_step
from bench.core.errors import Unsupported
from bench.run.case import Case
from bench.run.ranks import fake_process_group
from strategies import STRATEGIES
from tests.conformance import spec_for_tests

WORKLOAD = "gpt_mini:layers=2:width=32:heads=2:seq_len=16:dropout=0.0"
NAMESPACES = {"torch": torch, "torch.nn.functional": torch.nn.functional, "torch.Tensor": torch.Tensor,
              "torch.nn.Module": torch.nn.Module, "torch.autograd": torch.autograd,
              "torch.utils.checkpoint": torch.utils.checkpoint, "torch.optim.Optimizer": torch.optim.Optimizer}
MODULE_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                "_global_backward_hooks", "_global_module_registration_hooks")


class Stopped(Exception):
    """Raised in the third module's forward, as a plan candidate's check raises once over its limit."""


def _state() -> dict:
    """What a step could leave changed: each namespace's attributes by identity, the global module hooks, the
    process-wide modes and flags."""
    module = torch.nn.modules.module
    return {
        **{f"{name}.{attribute}": id(value) for name, space in NAMESPACES.items()
           for attribute, value in vars(space).items()},
        **{hooks: list(getattr(module, hooks)) for hooks in MODULE_HOOKS},
        "grad": torch.is_grad_enabled(), "inference": torch.is_inference_mode_enabled(),
        "autocast_cpu": torch.is_autocast_enabled("cpu"), "dtype": torch.get_default_dtype(),
        "cudnn": (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic),
        "deterministic": torch.are_deterministic_algorithms_enabled(), "threads": torch.get_num_threads(),
        "dispatch_modes": len(torch.utils._python_dispatch._get_current_dispatch_mode_stack()),
    }


@pytest.fixture(scope="module", autouse=True)
def _imports_made():
    """What a first step imports, imported before any state is taken: torch._dynamo's import wraps torch's own
    functions (`torch.manual_seed`) and its first compilation nn.Module's `__init__` and `__setstate__`, for good
    and in every process, which is no strategy's doing (a module imported later adds attributes: not compared)."""
    from torch._dynamo.mutation_guard import install_generation_tagging_init

    install_generation_tagging_init()
    tracked_step(Case(WORKLOAD, "baseline", "train", 4, "cpu"), "baseline", "cpu", cuda_autocast=False)


@pytest.mark.parametrize("name", STRATEGIES.names())
def test_a_step_stopped_inside_a_module_leaves_the_process_as_it_found_it(name):
    cls = STRATEGIES.get(name)
    if "train" not in cls.phases:
        pytest.skip(f"{name} has no training step")
    spec, ranks = spec_for_tests(name), 2 if cls.distributed else 1
    calls = [0]

    def stop_at_the_third_module(module, args):
        calls[0] += 1
        if calls[0] == 3:
            raise Stopped()

    before = _state()
    group = fake_process_group(ranks, 0) if cls.distributed else contextlib.nullcontext()
    hook = torch.nn.modules.module.register_module_forward_pre_hook(stop_at_the_third_module)
    try:
        with group:
            tracked_step(Case(WORKLOAD, spec, "train", 4, "cpu"), spec, "cpu", ranks=ranks, cuda_autocast=False)
    except Stopped:
        pass
    except Unsupported as why:
        pytest.skip(f"{name} on {WORKLOAD}: {why}")
    finally:
        hook.remove()
    if calls[0] < 3:
        pytest.skip(f"{name}: its step ran fewer than three modules")
    after = _state()
    assert {key: after.get(key) for key in before if after.get(key) != before[key]} == {}
