"""DeepSpeed's ZeRO-3 model-states estimator, run with DeepSpeed's own code, on membench's `hf:` models and GPU counts:
the peer's per-GPU figure for docs/peers.md.

`deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_cold(total_params, largest_layer_params,
num_gpus_per_node, num_nodes)` prints its table (per CPU, per GPU, for each offload option); its per-GPU figure without
offload is `4 * largest_layer_params + 18 * total_params / GPUs` bytes (DeepSpeed's mixed-precision model states:
16-bit weights and gradients, 32-bit master weights, gradients and Adam moments, partitioned; the largest layer's
16-bit weights and gradients gathered). It counts no activation, logits, temporary or communication buffer.

The counts are membench's model's, built on the meta device (`workload.build_model()`, transformers' task model in
float32): `parameters()` (a tied weight once) and the largest number of parameters one module holds itself, as
DeepSpeed's `model_to_params` computes them. `..._all_live(model)` is not called on that model: `model_to_params`
deduplicates parameters by `data_ptr()`, which is 0 for every meta tensor, so it would count one parameter tensor;
`--live` builds the model with real (uninitialised) storage on the CPU in bfloat16 (`to_empty`, then transformers'
`tie_weights`, since `to_empty` unties a tied head) and calls `_all_live` on it as well, a check that DeepSpeed's own
counting gives the same numbers (it needs 2 bytes a parameter of host memory: use
it for the 1B model, not the 8B one).

DeepSpeed is not a membench dependency: install it into a throw-away environment that sees membench's torch and
transformers (no CUDA, no compiled operators needed for these functions):

    .venv/bin/python -m venv /tmp/ds-venv
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/ds-venv/lib/python3.11/site-packages/zz_membench.pth
    /tmp/ds-venv/bin/pip install wheel setuptools
    DS_BUILD_OPS=0 /tmp/ds-venv/bin/pip install --no-build-isolation deepspeed==0.19.8
    DS_ACCELERATOR=cpu /tmp/ds-venv/bin/python tools/peers/deepspeed_zero3.py \\
        --presets llama-3.2-1b,llama-3.1-8b --gpus 8 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

GIB = 1024 ** 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="llama-3.2-1b,llama-3.1-8b", help="comma list of membench hf: presets")
    parser.add_argument("--gpus", default="8", help="comma list of GPU counts (one node each)")
    parser.add_argument("--live", default="", help="comma list of presets also given to ..._all_live on a real "
                                                   "(uninitialised, bfloat16) CPU model")
    parser.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    args.presets = [p for p in args.presets.split(",") if p]
    args.gpus = [int(g) for g in args.gpus.split(",") if g]
    args.live = [p for p in args.live.split(",") if p]
    if any(g < 1 for g in args.gpus):
        parser.error("--gpus must be positive")
    return args


def zero3_gpu_bytes(total_params: int, largest_layer_params: int, gpus: int) -> int:
    """DeepSpeed's per-GPU ZeRO-3 figure without offload, by its published formula (stage3.py): a check of its code."""
    return 4 * largest_layer_params + int(18 * total_params / gpus)


def counts(model) -> tuple[int, int]:
    """Parameters (a tied weight once) and the largest number one module holds itself (DeepSpeed's model_to_params,
    without its data_ptr deduplication, which a meta model defeats)."""
    total = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


def printed(function, *args, **kwargs) -> str:
    """What `function` prints."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        function(*args, **kwargs)
    return buffer.getvalue()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the estimators are arithmetic: no accelerator detection
    import torch

    from workloads import get_workload

    import deepspeed
    from deepspeed.runtime.zero.stage3 import (
        estimate_zero3_model_states_mem_needs, estimate_zero3_model_states_mem_needs_all_cold,
        estimate_zero3_model_states_mem_needs_all_live, model_to_params,
    )

    results = {"tool": "deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_cold",
               "deepspeed": deepspeed.__version__, "torch": torch.__version__, "rows": []}
    for preset in args.presets:
        workload = get_workload(f"hf:{preset}")
        with torch.device("meta"):
            model = workload.build_model()
        total, largest = counts(model)
        live = None
        if preset in args.live:
            start = time.perf_counter()
            real = model.to(torch.bfloat16).to_empty(device="cpu")  # storage, no initialisation
            if hasattr(real, "tie_weights"):  # to_empty gives a tied weight two new tensors: transformers re-ties
                real.tie_weights()
            live_counts = model_to_params(real)
            text = printed(estimate_zero3_model_states_mem_needs_all_live, real, num_gpus_per_node=args.gpus[0])
            live = {"params": live_counts[0], "largest_layer_params": live_counts[1], "printed": text,
                    "gpus": args.gpus[0], "wall_s": round(time.perf_counter() - start, 1)}
            del real
        del model
        for gpus in args.gpus:
            text = printed(estimate_zero3_model_states_mem_needs_all_cold, total, largest, num_gpus_per_node=gpus)
            _, gpu_bytes, largest_bytes = estimate_zero3_model_states_mem_needs(
                total, largest, num_gpus_per_node=gpus, num_nodes=1, cpu_offload=False, cpu_offload_params=False)
            assert gpu_bytes == zero3_gpu_bytes(total, largest, gpus), "DeepSpeed's formula changed"
            row = {"preset": preset, "gpus": gpus, "params": total, "largest_layer_params": largest,
                   "zero3_gpu_bytes_no_offload": gpu_bytes, "largest_layer_bytes": largest_bytes,
                   "printed": text}
            if live is not None and live["gpus"] == gpus:
                row["all_live"] = live
            results["rows"].append(row)
            print(text)
            print(f"{preset}, {gpus} GPUs: {total:,} parameters, largest layer {largest:,}; per GPU without offload "
                  f"{gpu_bytes:,} B = {gpu_bytes / GIB:.2f} GiB\n")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
