"""Small CPU cases for the strategy tests: one seeded step of a workload at a small batch, its strategy bound and
checked, verified against the baseline or measured for memory."""

from __future__ import annotations

from bench.run.case import Case, bind_case
from bench.run.fake_pass import fake_memory_pass
from bench.run.runner import MemoryResult, memory_pass, verify
from strategies import Strategy


def small_case(workload: str, spec: str, phase: str = "train", batch: int = 2) -> Case:
    """The case on the CPU with synthetic data, no warm-up and one timed step."""
    return Case(workload, spec, phase, batch, "cpu", data="synthetic", warmup=0, steps=1)


def bound(case: Case) -> Strategy:
    """The case's strategy, bound and checked (Unsupported where it does not apply)."""
    strategy, context = bind_case(case)
    strategy.check(context)
    return strategy


def verified(workload: str, spec: str, batch: int = 2) -> dict:
    """The verification columns of the training case against its baseline."""
    case = small_case(workload, spec, batch=batch)
    return verify(case, bound(case))


def measured(workload: str, spec: str, batch: int = 2) -> MemoryResult:
    """The memory pass of the training case."""
    case = small_case(workload, spec, batch=batch)
    return memory_pass(case, bound(case))


def measured_16bit_on_fake_tensors(workload: str, spec: str, batch: int = 2) -> MemoryResult:
    """The memory pass of a 16-bit training case as membench counts it where this CPU emulates 16-bit arithmetic, on
    fake tensors, whatever this CPU (bf16_weights on hf:gpt2:layers=1 at batch 1: the same peak, 527,783,664 B, in
    6.5 s where the real emulated step took 19.7 s)."""
    case = small_case(workload, spec, batch=batch)
    return fake_memory_pass(case, bound(case))
