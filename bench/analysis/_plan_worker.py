"""`python -m bench.analysis._plan_worker REQUEST ROWS`: a CUDA plan's search on CUDA's own operators, run by
`bench.analysis.plan.search_where_cuda_runs` in the fake-CUDA environment's Python (bench.measure.fake_cuda).

REQUEST is a JSON file of a `PlanRequest`; ROWS is written as {"rows": [...]}, or {"error": "..."} when the process
cannot plan at all (bench.analysis.fake_cuda_worker). Progress goes to stderr.
"""

from __future__ import annotations

import sys

from bench.analysis.fake_cuda_worker import serve


def search(values: dict) -> list[dict]:
    from bench.analysis import plan

    if values.get("capability"):
        values["capability"] = tuple(values["capability"])
    return plan.search(plan.PlanRequest(**values),
                       lambda text: print(f"{text} (fake CUDA)", file=sys.stderr, flush=True))


if __name__ == "__main__":
    sys.exit(serve(*sys.argv[1:3], search))
