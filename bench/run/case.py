"""A case -- (workload, strategy, phase, batch size, device) and how to time it -- seeded and bound to its strategy.

Every pass of a case starts from a fresh session built from the same seed, so each strategy sees the same initial
weights and the same batch as the baseline.
"""

from __future__ import annotations

import functools
import random
from dataclasses import asdict, dataclass
from typing import Any

import torch

from bench.measure import timing
from bench.measure.fake_cuda_mode import clear_on_fake_mode_change
from bench.run.rule_of_thumb import rule_of_thumb
from strategies import StepContext, Strategy, StrategySpec, bind_strategy
from workloads import get_workload


@dataclass(frozen=True)
class Case:
    """One measured configuration. `workload` is a workload spec (`deep_mlp:layers=100`, `file.py:NAME`).

    `strategy` may be given as text (`checkpoint+amp`): it becomes a `strategies.StrategySpec`, which is still that
    text (a case prints, compares and hashes as before: it is a dict and lru_cache key), is parsed once, on first
    use, and builds the case's strategy without parsing it again (`bind_case`); `case.strategy.spec()` is its
    canonical spelling. `to_json()` is what crosses to a worker process.
    """

    workload: str
    strategy: str
    phase: str
    batch_size: int
    device: str
    data: str | None = None  # None: the workload's default data source (its first)
    warmup: int = 3
    steps: int | None = 10  # exactly this many timed steps; None: adaptive, as the three below say
    min_steps: int = 5
    max_time_s: float = 60.0  # seconds of timed steps per repeat, at most (plus the step that crosses it)
    target_ci_rel: float = 0.05

    def __post_init__(self):
        object.__setattr__(self, "strategy", StrategySpec(self.strategy))
        if self.data is None:
            object.__setattr__(self, "data", get_workload(self.workload).data_sources[0])

    def label(self) -> str:
        """The case as progress lines name it: the workload with every option (`full_workload_spec`)."""
        return f"{full_workload_spec(self.workload)} {self.strategy} {self.phase} bs={self.batch_size} {self.device}"

    def timing_policy(self) -> timing.TimingPolicy:
        """How the timing pass of this case decides how many steps to time (bench.measure.timing.TimingPolicy)."""
        return timing.TimingPolicy(self.warmup, self.steps, self.min_steps, self.max_time_s, self.target_ci_rel)

    def to_json(self) -> dict[str, Any]:
        """The case as JSON values (`Case(**value)` makes it back, in another process)."""
        return {**asdict(self), "strategy": str(self.strategy)}


@functools.lru_cache(maxsize=64)
def full_workload_spec(spec: str) -> str:
    """`spec` with every option of its workload spelled out, defaults included (`workloads.Workload.full_spec`);
    `spec` itself where it does not resolve here."""
    try:
        return get_workload(spec).full_spec()
    except Exception:  # noqa: BLE001 - a label only: the case's own row says why its workload fails
        return str(spec)


@functools.lru_cache(maxsize=8)
def cpu_batch(workload_spec: str, batch_size: int, data: str):
    """The workload's `(inputs, target)` of `batch_size` from `data`, kept for the next cases of this process
    (emptied when a fake-CUDA mode starts and ends: no tensor may outlive its fake mode)."""
    return get_workload(workload_spec).make_batch(batch_size, data)


clear_on_fake_mode_change(cpu_batch.cache_clear)


def seed_everything(seed: int) -> None:
    """Seeds as the article's cookbook does: torch, Python's random, and every CUDA device."""
    torch.manual_seed(seed)
    random.seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def bind_case(case: Case, ranks: int = 1) -> tuple[Strategy, StepContext]:
    """A fresh instance of the case's strategy (built from its parsed spec) bound to its phase, device, (resolved)
    workload, batch size and the run's ranks; not yet checked."""
    return bind_strategy(case.strategy, case.phase, case.device, get_workload(case.workload), case.batch_size, ranks)


def rule_of_thumb_bytes(case: Case) -> int:
    """The article's estimate for the case (see `bench.run.rule_of_thumb`)."""
    return rule_of_thumb(case.workload, case.phase, case.batch_size)["total_bytes"]
