"""`python -m bench.analysis._predict_worker REQUEST ROWS`: predict's CUDA cases on CUDA's own operators, run by
`bench.analysis.predict.predict_cases` in the fake-CUDA environment's Python (bench.measure.fake_cuda).

REQUEST is a JSON file {"cases", "engine", "ranks", "capability"}; ROWS is written as {"rows": [...]}, or
{"error": "..."} when the process cannot predict at all. Progress goes to stderr, as predict's own does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(request_path: str, rows_path: str) -> int:
    from bench.run._worker import import_plugins

    try:
        import_plugins()
        from bench.analysis import predict
        from bench.run.runner import Case

        request = json.loads(Path(request_path).read_text())
        cases = [Case(**case) for case in request["cases"]]
        capability = tuple(request["capability"]) if request["capability"] else None

        def progress(index: int, case: Case) -> None:
            print(predict.progress_line(index, len(cases), case, " on fake CUDA"), file=sys.stderr, flush=True)

        rows = predict.predict_cases(cases, request["engine"], request["ranks"], capability, on_case=progress,
                                     snapshot_dir=request.get("snapshot_dir"))
    except KeyboardInterrupt:  # Ctrl-C reaches the caller too, which says what was interrupted
        return 130
    except Exception as error:  # noqa: BLE001 - the caller predicts in its own process instead, saying why
        Path(rows_path).write_text(json.dumps({"error": f"{type(error).__name__}: {error}".splitlines()[0]}))
        return 1
    Path(rows_path).write_text(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
