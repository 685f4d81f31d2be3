"""membench's per-rank prediction taken apart, to set it beside FSDPMemTracker's peak (docs/peers.md): the exact
live-tensor tracker's peak of the traced rank (512-byte blocks, what FSDPMemTracker also counts on CUDA), the
caching allocator model's max_memory_allocated without cuBLAS's workspaces, the row's figure (with them), and
max_memory_reserved.

It runs `bench.analysis.predict.predict_case` as `predict --ranks N --engine fake-cuda` does, keeping the traced step,
and replays the step's allocations through `bench.measure.cuda_allocator` twice (workspace 0, then cuBLAS's). Run it
in the fake-CUDA environment, with this checkout on the path:

    PYTHONPATH=. .venv-cuda-fake/bin/python tools/peers/membench_parts.py \\
        --workload hf:llama-3.2-1b:seq_len=2048 --ranks 8 --batch-size 8 --strategy fsdp [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="hf:llama-3.2-1b:seq_len=2048")
    parser.add_argument("--strategy", default="fsdp", help="e.g. fsdp or fsdp+checkpoint:segments=all")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8, help="the global batch")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from bench.analysis import predict
    from bench.analysis.fake_engine import cublas_workspace, device_capability
    from bench.measure import cuda_allocator
    from bench.run.case import Case

    kept = {}
    fill = predict._fill_figures

    def keeping(row, step, capability, notes):
        kept["step"] = step
        return fill(row, step, capability, notes)

    predict._fill_figures = keeping
    start = time.perf_counter()
    try:
        case = Case(args.workload, args.strategy, "train", args.batch_size, "cuda", data="synthetic")
        row = predict.predict_case(case, engine="fake-cuda", ranks=args.ranks)
    finally:
        predict._fill_figures = fill
    step = kept["step"]
    workspace = cublas_workspace(device_capability())
    without = cuda_allocator.replay(step.events, 0)
    with_workspaces = cuda_allocator.replay(step.events, workspace)
    result = {"workload": args.workload, "strategy": row["strategy"], "ranks": args.ranks,
              "global_batch": args.batch_size, "status": row["status"],
              "exact_tracker_peak_bytes": step.peak_bytes,
              "allocated_without_cublas_bytes": without.max_allocated_bytes,
              "allocated_bytes": with_workspaces.max_allocated_bytes, "row_allocated_bytes": row["predicted_bytes"],
              "reserved_bytes": with_workspaces.max_reserved_bytes, "cublas_workspace_bytes_each": workspace,
              "cublas_workspaces": with_workspaces.cublas_workspaces,
              "wall_s": round(time.perf_counter() - start, 1)}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
