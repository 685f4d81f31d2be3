"""membench's API to bench's analysis engine: every call from the `membench` package into bench.analysis goes here,
so that the coupling is one narrow module (predict's rows, fit's results, plan's search).

A workload that lives in this process only (made by `workload_from_callables` without `importable_as`) cannot be
resolved in another process: its CUDA predictions and plans run here, on the fake-CUDA engine where this torch sees
a CUDA device, else on PyTorch's fake tensors with the CPU's operators (the row's message says so).
"""

from __future__ import annotations

import math
from dataclasses import asdict

import torch

from bench.analysis import fit as fitting
from bench.analysis import plan as planning
from bench.analysis import plan_cost, plan_search, plan_tasks, predict
from bench.analysis.fake_cuda_worker import run_in_fake_cuda
from bench.core import gpus
from bench.measure import cpu_16bit, env, fake_cuda
from bench.measure.op_cost import measure_cpu_speed
from bench.run.isolation import process_state
from bench.run.case import Case

LOCAL_NOTE = ("the workload lives in this process only (no importable_as): not predicted in the fake-CUDA "
              "environment")


def resolvable_elsewhere(spec: str) -> bool:
    """Whether another process can resolve the workload spec (anything but `membench.workload:NAME`)."""
    return not str(spec).startswith("membench.workload:")


def predict_rows(cases: list[Case], capability: tuple[int, int] | None, engine: str = "auto",
                 snapshot_dir: str | None = None) -> list[dict]:
    """The predict table's rows of `cases`, as `python -m bench predict` makes them (`predict.predict_cases`); for a
    CUDA case of a workload other processes cannot resolve, predicted here (see the module's note)."""
    cuda = any(case.device == "cuda" for case in cases)
    if not cuda or torch.cuda.is_available() or all(resolvable_elsewhere(c.workload) for c in cases):
        return predict.predict_cases(cases, engine, 1, capability, snapshot_dir=snapshot_dir)
    rows = []
    for case in cases:
        with process_state():
            row = predict.predict_case(case, engine, 1, capability, snapshot_dir)
        row["message"] = "; ".join(x for x in (LOCAL_NOTE, row["message"]) if x)
        rows.append(row)
    return rows


def fit_rows(spec: str, strategies: list[str], budget: int, phase: str, device: str, data: str, max_batch: int,
             time_steps: int) -> list[dict]:
    """The fit table's rows (`python -m bench fit`'s CSV), baseline first."""
    results = fitting.fit(strategies, budget, phase, device, spec, data, max_batch, time_steps)
    return fitting.fit_rows(results)


def plan_request(spec: str, data: str, batch: int, gpu: str | None, budget: int | None, headroom: float,
                 max_candidates: int = planning.DEFAULT_MAX_CANDIDATES,
                 max_search_s: float = planning.DEFAULT_MAX_SEARCH_S) -> planning.PlanRequest:
    """The plan request of a workload at a batch for a GPU of bench.core.gpus (CUDA) or a `budget` in bytes on this
    CPU, as `python -m bench plan` makes it: the limit less `headroom`, the device's figures for step time."""
    found = gpus.find_gpu(gpu) if gpu else None
    device = "cuda" if found else "cpu"
    limit_source = budget if budget is not None else found.memory_bytes
    limit = math.floor(limit_source * (1 - headroom))
    context = gpus.CUDA_CONTEXT_BYTES if found else 0
    if found is not None:
        figures = plan_cost.gpu_figures(found)
    else:
        native = "native" if cpu_16bit.cpu_16bit_support().get("bfloat16") else "emulated"
        figures = plan_cost.cpu_figures(measure_cpu_speed(), f"this CPU ({env.cpu_name()}, bfloat16 {native})")
    return planning.PlanRequest(spec, data, batch, device, found.name if found else "this CPU", limit, context,
                                plan_cost.to_json(figures), 1, found.capability if found else None, False,
                                max_candidates, max_search_s, 1)


def plan_search_rows(spec: str, data: str, batch: int, gpu: str | None, budget: int | None, headroom: float,
                     max_candidates: int, max_search_s: float) -> tuple[list[dict], dict | None, str]:
    """(every candidate's row, the answer's row or None, a note) as `python -m bench plan` finds them, for a GPU of
    bench.core.gpus (CUDA) or a `budget` in bytes on this CPU."""
    request = plan_request(spec, data, batch, gpu, budget, headroom, max_candidates, max_search_s)
    note = ""
    if request.device == "cuda" and not torch.cuda.is_available() and not resolvable_elsewhere(spec):
        searched, note = plan_search.search(request), LOCAL_NOTE
    else:
        searched, note = plan_search.search_where_cuda_runs(request, lambda text: None)
    return searched.rows, planning.decide(searched.rows, False), note


def evaluate_candidates(candidates: list[tuple[planning.PlanRequest, str, int]]) -> tuple[list[dict], str]:
    """Each (request, strategy spec, members)'s plan row (predicted memory, judged against the request's limit,
    and the estimated step time), as `plan` evaluates a candidate, and a note on where they were predicted: for
    CUDA without a GPU all of them in one process of the fake-CUDA environment where it exists, else here."""
    as_json = [[asdict(request), spec, members] for request, spec, members in candidates]
    cuda = any(request.device == "cuda" for request, _, _ in candidates)
    note = ""
    if cuda and not torch.cuda.is_available():
        python = fake_cuda.environment_python()
        if python is not None:
            rows, why = run_in_fake_cuda(python, "bench.analysis._plan_worker", {"candidates": as_json})
            if rows is not None:
                return rows, ""
            note = f"the fake-CUDA environment failed ({why[:200]}): predicted here"
        else:
            note = f"{fake_cuda.unavailable_reason()}: predicted on the CPU's operators"
    return [plan_tasks.evaluate(*candidate) for candidate in as_json], note


def gpu_named(name: str) -> gpus.GPU:
    """The GPU of bench.core.gpus named `name` (`RTX 4090`, `h100`); a UsageError listing them otherwise."""
    return gpus.find_gpu(name)


__all__ = ["Case", "evaluate_candidates", "fit_rows", "gpu_named", "gpus", "plan_request", "plan_search_rows",
           "predict_rows", "resolvable_elsewhere"]
