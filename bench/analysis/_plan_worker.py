"""`python -m bench.analysis._plan_worker REQUEST ROWS`: a CUDA plan's search on CUDA's own operators, run by
`bench.analysis.plan_search.search_where_cuda_runs` in the fake-CUDA environment's Python (bench.measure.fake_cuda).

REQUEST is a JSON file of a `PlanRequest` (or of one candidate of it, for a Ray task); ROWS is written as `plan_search.Searched.to_json()` ({"rows": [...],
what was not tried}), or {"error": "..."} when the process
cannot plan at all (bench.analysis.fake_cuda_worker). Progress goes to stderr.
"""

from __future__ import annotations

import sys

from bench.analysis.fake_cuda_worker import serve


def search(values: dict) -> dict:
    """The whole search; or, for {"candidate": [spec, members, may_stop, probe], "request": ...}, that one
    candidate's row (a Ray task's, `plan_tasks.evaluate_on_ray`); or, for {"candidates": [[request, spec,
    members], ...]}, each one's row in turn, each with a request of its own (a dry run's changes, which may change
    the workload)."""
    from bench.analysis import plan, plan_search, plan_tasks

    if "candidate" in values:
        return {"rows": [dict(plan_tasks.evaluate(values["request"], *values["candidate"]))]}
    if "candidates" in values:  # [request, spec, members] each, in turn (a dry run's changes: membench.dry_run)
        return {"rows": [dict(plan_tasks.evaluate(*candidate)) for candidate in values["candidates"]]}
    if values.get("capability"):
        values["capability"] = tuple(values["capability"])
    return plan_search.search(plan.PlanRequest(**values),
                              lambda text: print(f"{text} (fake CUDA)", file=sys.stderr, flush=True)).to_json()


if __name__ == "__main__":
    sys.exit(serve(*sys.argv[1:3], search))
