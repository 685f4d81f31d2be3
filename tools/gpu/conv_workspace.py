"""On a GPU: what each convolution of a workload's step allocates beyond its outputs (cuDNN's workspace), call by call.

    python tools/gpu/conv_workspace.py --out FILE.csv --workload captcha_resnet18 --strategies baseline,amp
        [--phases train,eval] [--batch-sizes 8,32] [--steps 3]
    python tools/gpu/conv_workspace.py table bench/measure/tables/cudnn_workspace_sm90_cudnn919.csv PROBE.csv...

Each case (workload, strategy, phase, batch) runs `--steps` steps of membench's own session on the GPU under a
dispatch mode that, around every convolution operator (forward and `convolution_backward`), synchronises, resets the
allocator's peak and reads `memory_allocated` before and after and `max_memory_allocated`: what the call held beyond
its outputs at its peak is `peak - after` (the workspace, and any copy the call made of its inputs). One row per call,
with the call's shapes, strides, dtype, convolution parameters, output mask, step index (0 is the first step, when
cuDNN chooses its plan), and cuDNN's flags (benchmark, deterministic, allow_tf32). Peak statistics are reset by the
probe, so these steps are not the measured steps of a memory pass: the probe's rows describe calls, not the step.
`table` builds bench.measure.cudnn_workspace's table from such files.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.measure.cudnn_workspace import CONVOLUTION_OPS, convolution_call, key  # noqa: E402

COLUMNS = ["workload", "strategy", "phase", "batch_size", "step", "call", "op", "input_shape", "input_stride",
           "weight_shape", "grad_output_shape", "dtype", "stride", "padding", "dilation", "transposed", "groups",
           "output_mask", "channels_last", "before_bytes", "outputs_bytes", "peak_over_outputs_bytes",
           "cudnn_benchmark", "cudnn_deterministic", "cudnn_allow_tf32", "elapsed_ms"]


def _shape(value) -> str:
    return "x".join(map(str, value.shape)) if isinstance(value, torch.Tensor) else ""


def _stride(value) -> str:
    return "x".join(map(str, value.stride())) if isinstance(value, torch.Tensor) else ""


class ConvolutionProbe(TorchDispatchMode):
    """Measures every convolution call's bytes beyond its outputs; other operators pass through untouched."""

    def __init__(self, context: dict, rows: list[dict]):
        super().__init__()
        self.context, self.rows, self.calls = context, rows, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name not in CONVOLUTION_OPS:
            return func(*args, **kwargs)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        out = func(*args, **kwargs)
        torch.cuda.synchronize()
        elapsed = (time.perf_counter() - started) * 1e3
        after, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        self.rows.append(self.row(name, args, before, after, peak, elapsed))
        self.calls += 1
        return out

    def row(self, name: str, args: tuple, before: int, after: int, peak: int, elapsed: float) -> dict:
        call = convolution_call(name, args)
        return {**self.context, "call": self.calls, "op": name, "input_shape": _shape(call.data),
                "input_stride": _stride(call.data), "weight_shape": _shape(call.weight),
                "grad_output_shape": _shape(call.grad_output), "dtype": str(call.data.dtype).replace("torch.", ""),
                "stride": "x".join(map(str, call.stride)), "padding": "x".join(map(str, call.padding)),
                "dilation": "x".join(map(str, call.dilation)), "transposed": call.transposed, "groups": call.groups,
                "output_mask": call.mask, "channels_last": call.channels_last,
                "before_bytes": before, "outputs_bytes": after - before, "peak_over_outputs_bytes": peak - after,
                "cudnn_benchmark": torch.backends.cudnn.benchmark,
                "cudnn_deterministic": torch.backends.cudnn.deterministic,
                "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32, "elapsed_ms": round(elapsed, 3)}


def probe_case(workload: str, strategy: str, phase: str, batch_size: int, steps: int) -> list[dict]:
    """`steps` steps of the case under the probe; its rows (a case its strategy refuses: none)."""
    from bench.core.errors import Unsupported
    from bench.run.case import Case, bind_case
    from bench.run.passes import release_cuda_memory
    from bench.run.session import Session

    case = Case(workload, strategy, phase, batch_size, "cuda", data="synthetic")
    bound, context = bind_case(case)
    try:
        bound.check(context)
    except Unsupported:
        return []
    rows: list[dict] = []
    release_cuda_memory()
    session = Session(case, bound)
    with bound.session():
        for step in range(steps):
            with ConvolutionProbe({"workload": workload, "strategy": strategy, "phase": phase,
                                   "batch_size": batch_size, "step": step}, rows):
                session.step()
    del session
    release_cuda_memory()
    return rows


def table_key(row: dict) -> str:
    """A probe row's key in bench.measure.cudnn_workspace's table (that module's `signature` of the same call)."""
    backward = row["op"] == "convolution_backward"
    return key("backward" if backward else "forward", row["dtype"], row["input_shape"], row["weight_shape"],
               row["stride"], row["padding"], row["dilation"], str(row["transposed"]).lower() == "true",
               int(row["groups"]), str(int(float(row["output_mask"]))).zfill(3) if backward else "",
               str(row["channels_last"]).lower() == "true", str(row["cudnn_benchmark"]).lower() == "true")


def build_table(probes: list[Path], out: Path) -> int:
    """bench.measure.cudnn_workspace's table from probe files: per call signature, the least bytes a steady call
    (after the first step) held beyond its outputs (larger figures are the allocator's: a cached block handed out
    whole), the most, and how many calls."""
    seen: dict[str, list[int]] = {}
    for path in probes:
        with open(path, newline="") as handle:
            for row in csv.DictReader(handle):
                if int(row["step"]) >= 1:
                    seen.setdefault(table_key(row), []).append(int(row["peak_over_outputs_bytes"]))
    with open(out, "w", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(["signature", "workspace_bytes", "largest_seen_bytes", "calls"])
        for signature in sorted(seen):
            writer.writerow([signature, min(seen[signature]), max(seen[signature]), len(seen[signature])])
    return len(seen)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["table"]:  # python tools/gpu/conv_workspace.py table OUT.csv PROBE.csv...
        print(f"{build_table([Path(p) for p in argv[2:]], Path(argv[1]))} signatures -> {argv[1]}")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--strategies", default="baseline")
    parser.add_argument("--phases", default="train,eval")
    parser.add_argument("--batch-sizes", default="8,32")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with open(args.out, "a", newline="") as handle:
        writer = csv.DictWriter(handle, COLUMNS)
        if handle.tell() == 0:
            writer.writeheader()
        for strategy in args.strategies.split(","):
            for phase in args.phases.split(","):
                for batch in args.batch_sizes.split(","):
                    try:
                        rows = probe_case(args.workload, strategy, phase, int(batch), args.steps)
                    except Exception as error:  # one failed case is a line in the log, the others go on
                        print(f"{args.workload} {strategy} {phase} {batch}: {type(error).__name__}: {error}"[:400],
                              flush=True)
                        continue
                    writer.writerows(rows)
                    handle.flush()
                    written += len(rows)
                    print(f"{args.workload} {strategy} {phase} {batch}: {len(rows)} calls", flush=True)
    print(f"{written} rows -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
