"""`python -m bench.analysis._fit_worker REQUEST ROWS`: a CUDA `fit --over seq_len` search on CUDA's own operators,
run by `bench.analysis.fit_seq_len.fit_over_seq_len` in the fake-CUDA environment's Python (bench.measure.fake_cuda),
so that its probes are predictions in this one process (or its forked workers), not a new process per probe.

REQUEST is a JSON file of `fit_over_seq_len`'s arguments; ROWS is written as {"rows": [...]}, one `FitResult` as a
dict per strategy, or {"error": "..."} when the process cannot search at all (bench.analysis.fake_cuda_worker).
Progress goes to stderr, as the caller's own does.
"""

from __future__ import annotations

import sys
from dataclasses import asdict

from bench.analysis.fake_cuda_worker import serve


def search(request: dict) -> list[dict]:
    from bench.analysis import fit_seq_len

    capability = tuple(request.pop("capability")) if request.get("capability") else None
    specs = request.pop("specs")
    results = fit_seq_len.fit_over_seq_len(specs, capability=capability,
                                           progress=lambda text: print(text, file=sys.stderr, flush=True),
                                           **request)
    return [asdict(result) for result in results]


if __name__ == "__main__":
    sys.exit(serve(*sys.argv[1:3], search))
