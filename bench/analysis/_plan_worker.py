"""`python -m bench.analysis._plan_worker REQUEST ROWS`: a CUDA plan's search on CUDA's own operators, run by
`bench.analysis.plan.search_where_cuda_runs` in the fake-CUDA environment's Python (bench.measure.fake_cuda).

REQUEST is a JSON file of a `PlanRequest`; ROWS is written as {"rows": [...]}, or {"error": "..."} when the process
cannot plan at all. Progress goes to stderr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(request_path: str, rows_path: str) -> int:
    from bench.run._worker import import_plugins

    try:
        import_plugins()
        from bench.analysis import plan

        values = json.loads(Path(request_path).read_text())
        if values.get("capability"):
            values["capability"] = tuple(values["capability"])
        request = plan.PlanRequest(**values)
        rows = plan.search(request, lambda text: print(f"{text} (fake CUDA)", file=sys.stderr, flush=True))
    except KeyboardInterrupt:  # Ctrl-C reaches the caller too, which says what was interrupted
        return 130
    except Exception as error:  # noqa: BLE001 - the caller plans in its own process instead, saying why
        Path(rows_path).write_text(json.dumps({"error": f"{type(error).__name__}: {error}".splitlines()[0]}))
        return 1
    Path(rows_path).write_text(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
