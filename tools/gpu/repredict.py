"""Every case a lease measured on a GPU, predicted again by this checkout (on fake CUDA, for the GPU's compute
capability): measured against predicted, without the GPU.

    PYTHONPATH=. .venv-cuda-fake/bin/python tools/gpu/repredict.py LEASE_FOLDER OUT.csv [--capability 9.0]
        [--only WORKLOAD,...]

Reads the measured rows of the lease's gpu-check tables (check/gpu-check-*.csv) and prediction-check tables
(cuda_prediction/*.csv), one row per (workload, strategy, phase, batch): a case measured in a fresh process (the
gpu-check table) before one measured in a shared pytest process. Writes measured, predicted, their error and the
row's message; prints the median |error| and the rows below the measurement by more than 1%, per workload.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def measured_cases(lease: Path) -> dict[tuple, dict]:
    cases: dict[tuple, dict] = {}
    for source, pattern in (("fresh process", "check/gpu-check-*.csv"), ("pytest process", "cuda_prediction/*.csv")):
        for path in sorted(lease.glob(pattern)):
            with open(path, newline="") as handle:
                for row in csv.DictReader(line for line in handle if not line.startswith("#")):
                    if not row.get("measured_bytes"):
                        continue
                    workload, strategy, phase, batch = (row.get("workload"), row.get("strategy"), row.get("phase"),
                                                        row.get("batch_size"))
                    if not workload:
                        workload, strategy, phase, batch = row["anchor"].split(" ")
                    key = (workload, strategy, phase, int(batch))
                    cases.setdefault(key, {"measured_bytes": int(float(row["measured_bytes"])), "measured_in": source})
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lease", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--capability", default="9.0")
    parser.add_argument("--only", default="", help="workloads, comma-separated (default: all)")
    args = parser.parse_args(argv)
    from bench.analysis import predict
    from bench.run.case import Case

    capability = tuple(int(part) for part in args.capability.split("."))
    only = [name for name in args.only.split(",") if name]
    rows = []
    for (workload, strategy, phase, batch), measured in sorted(measured_cases(args.lease).items()):
        if only and workload not in only:
            continue
        row = predict.predict_case(Case(workload, strategy, phase, batch, "cuda", data="synthetic"),
                                   capability=capability)
        predicted = row.get("predicted_bytes")
        error = None if not predicted else round((predicted - measured["measured_bytes"]) / measured["measured_bytes"]
                                                 * 100, 2)
        rows.append({"workload": workload, "strategy": strategy, "phase": phase, "batch_size": batch,
                     "measured_bytes": measured["measured_bytes"], "measured_in": measured["measured_in"],
                     "predicted_bytes": predicted, "error_pct": error, "engine": row.get("engine"),
                     "cudnn_workspace_bytes": row.get("cudnn_workspace_bytes"), "message": row.get("message")})
        print(f"{workload} {strategy} {phase} {batch}: {error}%", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    for workload in sorted({row["workload"] for row in rows}):
        errors = [row["error_pct"] for row in rows if row["workload"] == workload and row["error_pct"] is not None]
        low = [row for row in rows if row["workload"] == workload and (row["error_pct"] or 0) < -1]
        below = [f"{row['strategy']} {row['phase']} {row['batch_size']} ({row['error_pct']:+.2f}%, "
                 f"{row['measured_in']})" for row in low]
        print(f"{workload}: {len(errors)} rows, median |error| {statistics.median(abs(e) for e in errors):.2f}%, "
              f"below by more than 1%: {len(below)}" + (f": {'; '.join(below)}" if below else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
