"""On a machine with an NVIDIA GPU: every single-GPU anchor's configuration measured there and predicted for that GPU.

    python tools/gpu/check.py --out DIR [--layers 2] [--jobs 4] [--deadline-s 300] [--only NAME,...]

Each anchor of bench/anchors/ that runs on one GPU becomes a case (its workload at `--layers` decoder layers, 0: full
size; its strategy, batch and sequence). A fresh process per case (so that each starts from an empty caching allocator
and an out-of-memory ends one case only) runs `bench.run.passes.memory_pass` on the GPU (max_memory_allocated and
max_memory_reserved of one steady-state step, as `compare --device cuda` measures) and then
`bench.analysis.predict.predict_case` on fake CUDA with this GPU's compute capability, in the same torch. The rows
(`bench.core.check_tables.PREDICTION_CHECK`, plus the anchor's name) go to DIR/gpu-check-<run>.csv and .md as each case
ends (the gpu-check table of results/README.md). Cases past `--deadline-s` are written as `skipped` rows, never
dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def anchor_cases(layers: int, only: list[str] | None, device: str = "cuda") -> list[dict]:
    """One case per anchor that runs on one GPU and whose strategy membench builds."""
    from bench.analysis import anchors

    cases = []
    for anchor in anchors.load_anchors(only=only):
        spec, _ = anchors.plan_row(anchor)
        if spec is None or anchor.ranks != 1:
            continue
        workload = anchor.workload() + (f":layers={layers}" if layers else "")
        cases.append({"anchor": anchor.name, "workload": workload, "strategy": spec, "phase": "train",
                      "batch_size": anchor.global_batch, "device": device, "data": "synthetic"})
    return cases


def run_one(request: dict) -> dict:
    """In the case's own process: measured on the GPU, then predicted for it; a comparison row (or why not)."""
    import torch

    from bench.analysis import predict, prediction_check
    from bench.core.errors import Unsupported
    from bench.measure.env import environment
    from bench.run.case import Case, bind_case
    from bench.run.passes import memory_pass, release_cuda_memory

    case = Case(**{key: value for key, value in request.items() if key not in ("anchor", "snapshot", "stacks")})
    if request.get("stacks"):  # C++ frames too (`stacks="all"`): names the library that made a frameless block
        record = torch.cuda.memory._record_memory_history

        def with_stacks(*args, **kwargs):
            if kwargs.get("enabled", "all") is not None:
                kwargs["stacks"] = request["stacks"]
            return record(*args, **kwargs)

        torch.cuda.memory._record_memory_history = with_stacks
    started = time.perf_counter()
    bound, context = bind_case(case)
    try:
        bound.check(context)
    except Unsupported as reason:
        return {"status": "unsupported", "message": str(reason)}
    result = memory_pass(case, bound, record_snapshot=bool(request.get("snapshot")))
    measured = dict(result)
    if case.device == "cuda":
        measured["nvidia_smi_bytes"] = nvidia_smi_used_bytes()
    if result.cuda_snapshot is not None:
        Path(request["snapshot"]).write_text(json.dumps(peak_summary(result.cuda_snapshot), indent=1))
        Path(request["snapshot"]).with_suffix(".trace.json").write_text(json.dumps(step_trace(result.cuda_snapshot)))
    del result
    measure_s = time.perf_counter() - started
    del bound
    if case.device == "cuda":
        release_cuda_memory()
    capability = torch.cuda.get_device_capability(0) if case.device == "cuda" else None
    prediction = predict.predict_case(case, capability=capability)
    row = dict(prediction_check.comparison_row(prediction, measured, environment(case.device)))
    row.update(status="ok" if prediction.get("status") == "ok" else prediction.get("status"),
               measure_s=round(measure_s, 1), predict_s=round(time.perf_counter() - started - measure_s, 1),
               sdpa_kernel=prediction.get("sdpa_kernel"), measured_nvidia_smi_bytes=measured.get("nvidia_smi_bytes"))
    return row


def frame_text(frame: dict) -> str:
    """One frame of CUDA's allocator history as `file.py:line function`."""
    return f"{Path(frame['filename']).name}:{frame['line']} {frame['name']}"


def peak_summary(snapshot: dict, top: int = 60) -> dict:
    """The measured step's allocations alive at its peak (CUDA's trace, requested bytes), largest first, each with the
    Python frames that made it (torch's own frames left out, torchao's kept); the blocks allocated before the step
    began are one total."""
    trace = snapshot["device_traces"][0] if snapshot.get("device_traces") else []
    start = snapshot.get("membench", {}).get("allocated_at_start_bytes", 0)
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: list[dict] = []
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif event["action"] in ("free_requested", "free_completed") and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]

    def frames(event: dict) -> list[str]:
        kept = [frame_text(f) for f in event.get("frames", [])
                if "/torch/" not in f["filename"] or "torchao" in f["filename"] or not f["filename"].endswith(".py")]
        return kept[:12]

    at_peak.sort(key=lambda event: -event["size"])
    return {"allocated_at_start_bytes": start, "step_peak_bytes_over_start": peak, "events": len(trace),
            "at_peak": [{"size": event["size"], "frames": frames(event)} for event in at_peak[:top]]}


def step_trace(snapshot: dict) -> list[dict]:
    """Every allocator event of the measured step in order (action, address, bytes, stream, the first frames
    outside torch), for finding what a prediction missed beyond the blocks alive at the peak."""
    trace = snapshot["device_traces"][0] if snapshot.get("device_traces") else []
    return [{"action": e["action"], "addr": e["addr"], "size": e["size"], "stream": e.get("stream"),
             "frames": [frame_text(f) for f in e.get("frames", [])][:8]}
            for e in trace]


def nvidia_smi_used_bytes() -> int | None:
    """What nvidia-smi says this process holds on the GPU (the CUDA context, the caching allocator's segments and any
    other allocation), in bytes; None where nvidia-smi does not answer."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip() == str(os.getpid()):
            return int(used.strip()) * 2**20
    return None


def run_in_subprocess(request: dict, timeout_s: float) -> dict:
    """`run_one` in a fresh Python; a row that says why when it fails or runs past `timeout_s`."""
    if timeout_s <= 0:
        return {**request, "status": "skipped", "message": "not run: the check's deadline had passed"}
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, __file__, "--one", json.dumps(request)], capture_output=True, text=True,
                              timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {**request, "status": "timeout", "message": f"still running after {timeout_s:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        status = "oom" if "OutOfMemory" in done.stderr else "error"
        return {**request, "status": status, "message": tail[:300], "wall_s": round(time.perf_counter() - started, 1)}
    return {**request, **json.loads(lines[-1]), "wall_s": round(time.perf_counter() - started, 1)}


def write(rows: list[dict], out: Path, run_id: str) -> None:
    """The rows so far as the gpu-check table (`bench.core.check_tables.GPU_CHECK`), atomically, and a markdown copy."""
    from bench.core.check_tables import GPU_CHECK
    from bench.core.results import write_table

    declared = [{key: value for key, value in row.items() if key in GPU_CHECK.names} for row in rows]
    # the first write creates the run's file (never over another run's), each later one rewrites it
    frame = write_table(GPU_CHECK, declared, out / f"gpu-check-{run_id}.csv", new=len(rows) == 1)
    columns = ["anchor", "strategy", "batch_size", "measured_bytes", "predicted_bytes", "error_pct",
               "measured_reserved_bytes", "predicted_reserved_bytes", "reserved_error_pct",
               "measured_nvidia_smi_bytes", "sdpa_kernel", "status", "wall_s", "message"]
    (out / f"gpu-check-{run_id}.md").write_text(f"```\n{frame[columns].to_string(index=False)}\n```\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/gpu_check"))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--deadline-s", type=float, default=300.0)
    parser.add_argument("--case-timeout-s", type=float, default=240.0)
    parser.add_argument("--only", default="", help="anchors (names or sources, comma-separated); default: all")
    parser.add_argument("--case", action="append", default=[], help="WORKLOAD,STRATEGY,PHASE,BATCH: one more case")
    parser.add_argument("--no-anchors", action="store_true", help="only the --case cases")
    parser.add_argument("--snapshot", default="", help="anchors (or cases) whose measured step's allocator history "
                        "is written beside the table, comma-separated")
    parser.add_argument("--stacks", default="", help="cases (as --snapshot) whose history records C++ frames too")
    parser.add_argument("--device", default="cuda", help="cpu: the same plumbing without a GPU (a dry run)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(json.loads(args.one)), default=str))
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: --device cuda needs a GPU, and torch.cuda.is_available() is False here; --device cpu "
                  "runs the same cases on the CPU (membench's count is exact there)", file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-layers{args.layers}"
    cases = [] if args.no_anchors else anchor_cases(args.layers, [name for name in args.only.split(",") if name] or None,
                                                    args.device)
    deadline = time.monotonic() + args.deadline_s
    for spec in args.case:
        workload, strategy, phase, batch = spec.split(",")
        cases.append({"anchor": f"{workload} {strategy} {phase} {batch}", "workload": workload, "strategy": strategy,
                      "phase": phase, "batch_size": int(batch), "device": args.device, "data": "synthetic"})
    for case in cases:
        if args.snapshot and case["anchor"] in args.snapshot.split(","):
            case["snapshot"] = str((args.out / (case["anchor"].replace(" ", "_") + ".peak.json")).resolve())
            if case["anchor"] in args.stacks.split(","):
                case["stacks"] = "all"
    rows: list[dict] = []
    lock = threading.Lock()

    def one(request: dict) -> dict:
        row = run_in_subprocess(request, min(args.case_timeout_s, deadline - time.monotonic()))
        with lock:
            rows.append(row)
            write(rows, args.out, run_id)
        print(f"{row.get('anchor')}: {row.get('status')} measured={row.get('measured_bytes')} "
              f"predicted={row.get('predicted_bytes')} error={row.get('error_pct')}% "
              f"({row.get('wall_s')} s) {row.get('message', '')[:160]}", flush=True)
        return row

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(one, cases))
    print(f"{len(rows)} cases; wrote {args.out}/gpu-check-{run_id}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
