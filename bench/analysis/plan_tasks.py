"""How one plan candidate runs for the search (`bench.analysis.plan_search`): here or in a forked worker process from a
JSON request, as a Ray task (in the node's fake-CUDA environment where its torch sees no CUDA), and the row of one
whose worker or task was lost."""

from __future__ import annotations

from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import torch

from bench.analysis import plan, plan_cost
from bench.analysis.fake_cuda_worker import run_in_fake_cuda
from bench.core.results import PLAN, Status
from bench.core.schema import Row
from bench.measure import fake_cuda


def evaluate(request: dict, spec: str, members: int, may_stop: bool = False, probe: bool = True) -> Row:
    """`plan.evaluate` of a JSON request; `may_stop`: the search's candidates (a combination, or a setting that
    changes what is trained, stops once it certainly cannot fit: the search needs no figure of it then); `probe`:
    as `plan.evaluate`'s (False for a combination whose members' ratios promise that it fits)."""
    values = {**request, "capability": tuple(request["capability"]) if request.get("capability") else None}
    the_request = plan.PlanRequest(**values)
    return plan.evaluate(the_request, spec, members, plan_cost.from_json(the_request.figures), may_stop, probe)


def evaluate_on_ray(request: dict, spec: str, members: int, may_stop: bool, probe: bool, planner_venv: str) -> Row:
    """A Ray task's candidate (`bench.run.ray_executor.RayPool`: one thread). A CUDA plan on a node whose torch
    sees no CUDA runs it in a fake-CUDA environment (`make cuda-fake-env`) where the node has one, as the search
    does on one machine: the planner's (`planner_venv`: there on a local Ray, and on nodes that share its paths),
    else one beside the code the task got; else on the CPU's operators, its row's message saying so."""
    if request["device"] != "cuda" or torch.cuda.is_available():
        return evaluate(request, spec, members, may_stop, probe)
    python = fake_cuda.environment_python(Path(planner_venv)) or fake_cuda.environment_python()
    why = fake_cuda.unavailable_reason(Path(planner_venv))
    if python is not None:
        answer, why = run_in_fake_cuda(python, "bench.analysis._plan_worker",
                                       {"candidate": [spec, members, may_stop, probe], "request": request})
        if answer is not None:
            return PLAN.row(answer[0])
        why = f"the fake-CUDA environment failed ({why[:200]})"
    row = evaluate(request, spec, members, may_stop, probe)
    row["message"] = "; ".join(x for x in (row["message"], f"{why}: predicted on the CPU's operators") if x)[:500]
    return row


def lost_row(request: plan.PlanRequest, spec: str, error: BaseException) -> Row:
    """The error row of a candidate whose worker process died or whose Ray task failed (`error`), saying which."""
    row = plan.empty_row(request, spec, spec.count("+") + 1 if spec != "baseline" else 0)
    where = "its worker process died" if isinstance(error, BrokenProcessPool) else "its Ray task failed"
    first = next((line for line in str(error).splitlines() if line.strip()), "").strip()
    row.update(status=Status.ERROR.value, message=f"{where} ({type(error).__name__}: {first})"[:300])
    return row
