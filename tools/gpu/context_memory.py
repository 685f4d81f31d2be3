"""On a GPU: what a process holds outside PyTorch's caching allocator (nvidia-smi's figure less `memory_reserved`),
after each of a list of workloads of the GPU's libraries, each in a fresh process.

    python tools/gpu/context_memory.py --out FILE.csv [--only NAME,...]

Scenarios: the CUDA context alone; a float32, float16, bfloat16 matrix product (cuBLAS, cuBLASLt); a product on a
second stream; a product in autograd's backward (its own thread); a cuDNN convolution forward and backward; SDPA
(flash) forward and backward; NCCL (one rank); and whole training steps of membench's workloads. Each row: the
process's nvidia-smi figure, `memory_reserved`, `memory_allocated`, and their difference (`outside_bytes`), and the
whole device's used memory from `cudaMemGetInfo` for the context alone.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from check import nvidia_smi_used_bytes  # noqa: E402 (tools/gpu/check.py, beside this script)


def _matmul(dtype_name: str, stream: bool = False, backward: bool = False):
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(4096, 4096, device="cuda", dtype=dtype, requires_grad=backward)
    if stream:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            (a @ a).sum()
        torch.cuda.synchronize()
    out = a @ a
    if backward:
        out.sum().backward()


def _conv(dtype_name: str = "float32", benchmark: bool = False):
    import torch

    torch.backends.cudnn.benchmark = benchmark
    dtype = getattr(torch, dtype_name)
    x = torch.randn(32, 64, 56, 56, device="cuda", dtype=dtype, requires_grad=True)
    conv = torch.nn.Conv2d(64, 64, 3, padding=1).cuda().to(dtype)
    conv(x).sum().backward()


def _sdpa():
    import torch

    q = torch.randn(4, 16, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()


def _nccl():
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    dist.destroy_process_group()


def _step(workload: str, strategy: str, batch: int):
    from bench.run.case import Case, bind_case
    from bench.run.session import Session

    case = Case(workload, strategy, "train", batch, "cuda", data="synthetic")
    bound, context = bind_case(case)
    bound.check(context)
    session = Session(case, bound)
    with bound.session():
        for _ in range(3):
            session.step()


SCENARIOS = {
    "context": lambda: None,
    "matmul_float32": lambda: _matmul("float32"),
    "matmul_float16": lambda: _matmul("float16"),
    "matmul_bfloat16": lambda: _matmul("bfloat16"),
    "matmul_all_dtypes": lambda: [_matmul(d) for d in ("float32", "float16", "bfloat16")],
    "matmul_second_stream": lambda: _matmul("float32", stream=True),
    "matmul_backward_thread": lambda: _matmul("float32", backward=True),
    "matmul_backward_thread_bfloat16": lambda: _matmul("bfloat16", backward=True),
    "conv_float32": lambda: _conv("float32"),
    "conv_float16": lambda: _conv("float16"),
    "conv_benchmark": lambda: _conv("float32", benchmark=True),
    "sdpa_bfloat16": _sdpa,
    "nccl_one_rank": _nccl,
    "step_captcha_baseline_32": lambda: _step("captcha_resnet18", "baseline", 32),
    "step_captcha_amp_32": lambda: _step("captcha_resnet18", "amp", 32),
    "step_gpt_mini_amp_bf16_16": lambda: _step("gpt_mini", "amp:dtype=bfloat16", 16),
    "step_gpt_mini_baseline_16": lambda: _step("gpt_mini", "baseline", 16),
    "step_llama_2_layers_lora": lambda: _step("hf:llama-3.2-1b:layers=2:seq_len=1024", "lora", 2),
}


def run_one(name: str) -> dict:
    import torch

    free0, total = torch.cuda.mem_get_info()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    SCENARIOS[name]()
    torch.cuda.synchronize()
    used = nvidia_smi_used_bytes()
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    return {"scenario": name, "nvidia_smi_bytes": used, "reserved_bytes": reserved, "allocated_bytes": allocated,
            "outside_bytes": None if used is None else used - reserved,
            "max_reserved_bytes": torch.cuda.max_memory_reserved(),
            "device_used_before_first_tensor_bytes": total - free0,
            "device_used_after_first_tensor_bytes": total - free1,
            "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "lazy_loading": os.environ.get("CUDA_MODULE_LOADING", "(default)")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="the table's file (required but with --one)")
    parser.add_argument("--only", default="")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one)))
        return 0
    if args.out is None:
        parser.error("--out is required")
    names = [n for n in args.only.split(",") if n] or list(SCENARIOS)
    rows = []
    for name in names:  # one at a time: nvidia-smi is read per process, but contexts beside it load the driver
        done = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True, timeout=120,
                              cwd=ROOT)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        row = json.loads(lines[-1]) if lines else {"scenario": name, "error": (done.stderr.strip() or "?")[-300:]}
        rows.append(row)
        print(row, flush=True)
    keys = list(dict.fromkeys(key for row in rows for key in row))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, keys)
        writer.writeheader()
        writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
