"""`python -m bench.analysis._predict_worker REQUEST ROWS`: predict's CUDA cases on CUDA's own operators, run by
`bench.analysis.predict.predict_cases` in the fake-CUDA environment's Python (bench.measure.fake_cuda).

REQUEST is a JSON file {"cases", "engine", "ranks", "capability", "snapshot_dir"}; ROWS is written as {"rows": [...]},
or {"error": "..."} when the process cannot predict at all (bench.analysis.fake_cuda_worker). Progress goes to stderr,
as predict's own does.
"""

from __future__ import annotations

import sys

from bench.analysis.fake_cuda_worker import serve


def predict_all(request: dict) -> list[dict]:
    from bench.analysis import predict
    from bench.run.case import Case

    cases = [Case(**case) for case in request["cases"]]
    capability = tuple(request["capability"]) if request["capability"] else None

    def progress(index: int, case: Case) -> None:
        print(predict.progress_line(index, len(cases), case, " on fake CUDA"), file=sys.stderr, flush=True)

    return predict.predict_cases(cases, request["engine"], request["ranks"], capability, on_case=progress,
                                 snapshot_dir=request.get("snapshot_dir"))


if __name__ == "__main__":
    sys.exit(serve(*sys.argv[1:3], predict_all))
