"""`membench.plan` and `membench.fit`: the fastest combination of techniques that fits a GPU (or a budget), and the
largest batch under a budget, for the user's model, returning the rows `python -m bench plan` and `fit` print."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from bench.cli.arguments import headroom_fraction, non_negative_int, positive_float, positive_int
from bench.core import gpus
from bench.core.units import MiB, parse_positive_size
from bench.run.isolation import process_state
from bench.run.preflight import check_choice, check_steps, parse_batch_size
from membench import _engine
from membench.estimating import DEVICES, as_workload, batch_size_of, config_job, strategy_specs
from membench.workload import InputError, parsed
from strategies import PHASES
from workloads import Workload


def size_bytes(value: int | str, what: str) -> int:
    """`value` (bytes, or a size such as "24GiB") in bytes; an InputError naming `what` where it is none."""
    try:
        return parse_positive_size(value)
    except ValueError as error:
        raise InputError(f"{what}: bad size {value!r}: {error}") from None


@dataclass
class Plan:
    """The plan's rows (the plan table's, one per candidate, as `plan`'s CSV), the answer's row (None when nothing
    fits) and a note on how it was predicted.

    Example: `membench.plan(build, batch, loss_fn, gpu="RTX 4090").strategy` is the answer's spec, e.g.
    `"baseline"` or `"checkpoint+amp"`."""

    workload: str
    target: str
    rows: list[dict] = field(repr=False)
    answer: dict | None = field(repr=False)
    note: str = ""

    @property
    def strategy(self) -> str | None:
        """The answer's strategy spec; None when no candidate fits."""
        return self.answer["strategy"] if self.answer else None

    @property
    def front(self) -> list[dict]:
        """The Pareto front's rows (no candidate both smaller and faster), fastest first."""
        return sorted((r for r in self.rows if r.get("on_front")), key=lambda r: r["est_step_time_ms"])

    def __str__(self) -> str:
        lines = [f"plan for {self.workload} on {self.target}: "
                 + (f"{self.strategy}" if self.answer else "nothing fits")]
        for r in self.front:
            judged = "-" if r.get("judged_bytes") is None else f"{r['judged_bytes'] / MiB:,.1f} MiB"
            lines.append(f"  {r['strategy']:<40} {judged:>14} {r['est_step_time_ms']:>10,.1f} ms"
                         + ("  <- answer" if r.get("answer") else ""))
        return "\n".join(lines + ([f"  note: {self.note}"] if self.note else []))


def plan(model: Callable[[], nn.Module] | nn.Module | Workload | str | None = None, batch: Any = None,
         loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
         optimizer: Callable[[Any], torch.optim.Optimizer] | None = None, *, gpu: str | None = None,
         budget: int | str | None = None, headroom: float = gpus.DEFAULT_HEADROOM, batch_size: int | None = None,
         max_candidates: int = gpus.DEFAULT_MAX_CANDIDATES, max_search_s: float = gpus.DEFAULT_MAX_SEARCH_S,
         name: str = "my_model", config: Any = None, overrides: Sequence[str] = (), peft_config: Any = None,
         quantization_config: Any = None, **workload_options: Any) -> Plan:
    """The fastest candidate (strategies and their combinations) whose predicted memory fits `gpu` (a name of
    `python -m bench plan --list-gpus`) or, on this CPU, `budget` (bytes, or a size such as `"500MiB"`), less
    `headroom`; the inputs are `estimate`'s. Nothing runs at full size: every candidate is predicted.

    Example:
        >>> p = plan(lambda: torch.nn.Linear(32, 32), (torch.ones(8, 32), torch.zeros(8, 32)),
        ...          torch.nn.functional.mse_loss, gpu="RTX 4090", max_candidates=2, name="doc_plan")
        >>> p.strategy
        'baseline'
    """
    if (gpu is None) == (budget is None):
        raise InputError("gpu/budget: give exactly one: gpu=NAME plans for CUDA, budget=SIZE for this CPU")
    found = None if gpu is None else parsed("gpu", gpus.find_gpu, gpu)  # each as `plan`'s option of that name
    headroom = parsed("headroom", headroom_fraction, str(headroom))
    max_candidates = parsed("max_candidates", positive_int, str(max_candidates))
    max_search_s = parsed("max_search_s", positive_float, str(max_search_s))
    if config is not None:  # `estimate`'s config=: plan for the configuration's model and batch
        job = config_job(config, overrides, peft_config, quantization_config, model)
        model, batch_size = job.workload, batch_size or job.batch_size
    workload = as_workload(model, batch, loss_fn, optimizer, name, **workload_options)
    limit = None if budget is None else size_bytes(budget, "budget")
    size = batch_size_of(batch_size, workload)
    with process_state():  # the user's model is built and stepped here: its global changes do not outlive the call
        rows, answer, note = _engine.plan_search_rows(workload.spec(), workload.data_sources[0], size, gpu, limit,
                                                      headroom, max_candidates, max_search_s)
    target = found.name if found else "this CPU"
    return Plan(workload.spec(), target, rows, answer, note)


def fit(model: Callable[[], nn.Module] | nn.Module | Workload | str | None = None, batch: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        optimizer: Callable[[Any], torch.optim.Optimizer] | None = None, *, budget: int | str,
        strategies: str | Sequence[str] = (), device: str = "cpu", phase: str = "train", max_batch: int = 4096,
        time_steps: int = 0, name: str = "my_model", config: Any = None, overrides: Sequence[str] = (),
        peft_config: Any = None, quantization_config: Any = None, **workload_options: Any) -> list[dict]:
    """The largest batch whose peak stays under `budget` (bytes or `"2GiB"`), per strategy (baseline first): the
    rows of `python -m bench fit`'s table. On the CPU each answer is confirmed by a real run (so keep the budget
    below this machine's memory); on `device="cuda"` without a GPU it is predicted. `time_steps` > 0 also times
    the answer.

    Example:
        >>> rows = fit(lambda: torch.nn.Linear(32, 32), (torch.ones(8, 32), torch.zeros(8, 32)),
        ...            torch.nn.functional.mse_loss, budget="1MiB", max_batch=64, name="doc_fit")
        >>> rows[0]["strategy"], 1 <= rows[0]["batch_size"] <= 64
        ('baseline', True)
    """
    device = parsed("device", check_choice, "device", device, DEVICES, "device")  # each as `fit`'s option
    phase = parsed("phase", check_choice, "phase", phase, PHASES, "phase")
    max_batch = parsed("max_batch", parse_batch_size, max_batch, "max_batch")
    time_steps = parsed("time_steps", non_negative_int, str(time_steps))
    parsed("time_steps", check_steps, time_steps, "time_steps", 0)
    budget = size_bytes(budget, "budget")
    if config is not None:  # `estimate`'s config=: the configuration's model and strategy, the batch searched
        job = config_job(config, overrides, peft_config, quantization_config, model)
        model, strategies = job.workload, [job.strategy]
    specs = strategy_specs(strategies) if isinstance(strategies, str) or strategies else []
    workload = as_workload(model, batch, loss_fn, optimizer, name, **workload_options)
    with process_state():  # the user's model is built and stepped here: its global changes do not outlive the call
        return _engine.fit_rows(workload.spec(), specs, budget, phase, device, workload.data_sources[0], max_batch,
                                time_steps)
