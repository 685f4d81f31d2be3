"""Regenerate the tables of docs/peers.md: membench's predicted CUDA training peak of each `hf:` preset beside
accelerate's and DeepSpeed's estimators for the same configuration.

membench's figures come from `python -m bench predict ... --device cuda --phases train` (a subprocess per preset,
fake-CUDA engine where `make cuda-fake-env` has made it); its CSV is read back. accelerate's figure is computed with
accelerate's own code (`accelerate.commands.estimate`: the model `accelerate estimate-memory` builds, transformers'
`AutoModel` on the meta device, sized by `calculate_maximum_sizes`, then `estimate_training_usage`), on membench's
configuration of the preset. DeepSpeed's figures are DeepSpeed's own `estimate_zero2_model_states_mem_needs` and
`estimate_zero3_model_states_mem_needs` where `import deepspeed` works, else the same published formulas, and the
table says which.

Usage (from the repository root, with the project's virtual environment):

    .venv/bin/python tools/peers/presets_table.py [--presets gpt2,bert-base-uncased] [--out DIR] [--reuse]

It writes the peers' figures to DIR/estimators.csv beside the predict CSVs and prints the tables of docs/peers.md
from that folder with tools/docs/figure_blocks.py's own generators (one table, one code). The committed run
(results/reference/peers/, whose tables tools/docs/figures.py writes into docs/peers.md):

    .venv/bin/python tools/peers/presets_table.py --out results/reference/peers

DeepSpeed need not be importable; to use its own code without building its ops (no GPU needed):

    .venv/bin/pip install --no-deps --no-build-isolation --target /tmp/ds deepspeed==0.19.8 \
        hjson einops ninja py-cpuinfo
    PYTHONPATH=/tmp/ds .venv/bin/python tools/peers/presets_table.py
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools" / "docs"))

import figure_blocks  # noqa: E402  (the tables of docs/peers.md, printed here as figures.py writes them there)

BIG = ("llama-3.1-8b", "mistral-7b", "qwen2.5-7b")
# Sequence length per preset: bert's position table ends at 512, gpt2's at 1024; the decoders at a common 4096
SEQ_LEN = {"gpt2": 1024, "bert-base-uncased": 512, "llama-3.2-1b": 4096, "llama-3.1-8b": 4096, "mistral-7b": 4096,
           "qwen2.5-7b": 4096}
LORA = ("lora", "lora+checkpoint", "lora+checkpoint+chunked_loss")


def strategies_of(preset: str) -> list[str]:
    """The strategies predicted for `preset`, the baseline first (predict predicts it only where named): amp only for
    the 7-8B models."""
    return ["baseline", *LORA, "amp"] if preset in BIG else ["baseline", *LORA]


def run_predict(preset: str, out: Path, reuse: bool) -> tuple[list[dict], float | None, str]:
    """The predict CSV's rows for `preset`, the command's wall time (None when reused) and its printed output."""
    folder = out / preset
    found = sorted(folder.glob("predict-*.csv")) if reuse else []
    if found:
        log = folder / "stdout.txt"
        return list(csv.DictReader(found[-1].open())), None, log.read_text() if log.exists() else ""
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "bench", "predict", "--workload", f"hf:{preset}:seq_len={SEQ_LEN[preset]}",
               "--device", "cuda", "--batch-size", "1", "--strategies", ",".join(strategies_of(preset)),
               "--phases", "train", "--out", str(folder)]
    print("$", " ".join(command[1:]), file=sys.stderr, flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    (folder / "stdout.txt").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"predict failed for {preset} (exit {done.returncode}):\n{done.stderr[-3000:]}")
    print(f"  {wall:.0f} s", file=sys.stderr, flush=True)
    return list(csv.DictReader(sorted(folder.glob("predict-*.csv"))[-1].open())), wall, done.stdout


def model_sizes(preset: str) -> dict:
    """Parameter counts of membench's model of `preset` and accelerate's estimate, both on the meta device."""
    import torch

    from workloads import get_workload

    # first: membench's import of transformers imports torchvision without its compiled operators, which fail to
    # register in this CPU build; accelerate's estimate module imports timm, and so torchvision
    workload = get_workload(f"hf:{preset}:seq_len={SEQ_LEN[preset]}")

    import accelerate
    from accelerate import init_empty_weights
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoModel

    with torch.device("meta"):  # (under init_empty_weights a tied head's weight would be a second parameter)
        model = workload.build_model()  # the task's class membench trains (with its output head)
    with init_empty_weights():
        # what `accelerate estimate-memory <name>` builds for a transformers model: AutoModel, float32
        base = AutoModel.from_config(workload.config(), dtype=torch.float32)  # estimate-memory: torch_dtype, renamed
    params = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    # DeepSpeed's model_to_params: the largest number of parameters held directly by one module
    largest_layer = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    total_size, _ = calculate_maximum_sizes(base)  # parameters and buffers, float32
    return {
        "params": params, "largest_layer_params": largest_layer, "accelerate_version": accelerate.__version__,
        "accelerate_params": sum(p.numel() for p in base.parameters()),
        "accelerate_weights_fp32": total_size,
        # estimate-memory's "Training using Adam" column is the largest of its stages (model, gradients, optimizer,
        # step): 4x the float32 size in float32, 2x in float16/bfloat16 (mixed precision)
        "accelerate_train_fp32": max(estimate_training_usage(total_size, "float32").values()),
        "accelerate_train_mixed": max(estimate_training_usage(total_size, "float16").values()),
    }


def deepspeed_estimates(params: int, largest_layer: int) -> dict:
    """DeepSpeed's per-GPU model-states estimate on one GPU without offload, by its own code where importable."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # its estimators are arithmetic: no accelerator detection
    try:
        import deepspeed
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except Exception:  # not installed, or its import fails here: DeepSpeed's published formulas (its docs)
        return {"source": "DeepSpeed's published formulas (not its code)",
                "zero2": 2 * params + 18 * params, "zero3": 4 * largest_layer + 18 * params}
    _, zero2 = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=1, num_nodes=1, cpu_offload=False)
    _, zero3, _ = estimate_zero3_model_states_mem_needs(params, largest_layer, num_gpus_per_node=1, num_nodes=1,
                                                        cpu_offload=False, cpu_offload_params=False)
    return {"source": f"DeepSpeed {deepspeed.__version__}'s own functions", "zero2": zero2, "zero3": zero3}


ESTIMATOR_COLUMNS = ("preset", "seq_len", "params", "largest_layer_params", "accelerate_version", "accelerate_params",
                     "accelerate_weights_fp32_bytes", "accelerate_train_fp32_bytes", "accelerate_train_mixed_bytes",
                     "deepspeed_source", "deepspeed_zero2_bytes", "deepspeed_zero3_bytes")


def write_estimators(path: Path, results: dict) -> None:
    """One row per preset: its parameter counts and accelerate's and DeepSpeed's estimates, in bytes."""
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=ESTIMATOR_COLUMNS)
        writer.writeheader()
        for preset, (_, sizes, ds) in results.items():
            writer.writerow({
                "preset": preset, "seq_len": SEQ_LEN[preset], "params": sizes["params"],
                "largest_layer_params": sizes["largest_layer_params"],
                "accelerate_version": sizes["accelerate_version"], "accelerate_params": sizes["accelerate_params"],
                "accelerate_weights_fp32_bytes": sizes["accelerate_weights_fp32"],
                "accelerate_train_fp32_bytes": int(sizes["accelerate_train_fp32"]),
                "accelerate_train_mixed_bytes": int(sizes["accelerate_train_mixed"]),
                "deepspeed_source": ds["source"], "deepspeed_zero2_bytes": int(ds["zero2"]),
                "deepspeed_zero3_bytes": int(ds["zero3"])})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default=",".join(SEQ_LEN), help="comma list of hf presets")
    parser.add_argument("--out", default=None, help="folder for the predict CSVs and estimators.csv "
                                                    "(default: a temporary one)")
    parser.add_argument("--reuse", action="store_true", help="read the CSVs already in --out instead of predicting")
    args = parser.parse_args()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="peers-"))
    presets = args.presets.split(",")

    results, capabilities, walls = {}, set(), {}
    for preset in presets:
        rows, wall, stdout = run_predict(preset, out, args.reuse)
        capabilities.update(re.findall(r"compute capability (\d+\.\d+)", stdout))
        walls[preset] = wall
        sizes = model_sizes(preset)
        results[preset] = (rows, sizes, deepspeed_estimates(sizes["params"], sizes["largest_layer_params"]))
    write_estimators(out / "estimators.csv", results)

    first = next(iter(results.values()))
    print(f"membench predict (engine {figure_blocks.row_of(first[0], 'baseline')['engine']}, capability "
          f"{', '.join(sorted(capabilities)) or '?'}), batch 1, train; accelerate {first[1]['accelerate_version']}; "
          f"{first[2]['source']}. GiB (2^30 bytes).\n")
    page = ROOT / "docs" / "peers.md"
    print("Full fine-tune with AdamW, float32, batch 1, train:\n")
    print(figure_blocks.peers_estimators(out, page))
    print("\nmembench by technique (allocated / reserved GiB, predicted, fake CUDA; neither peer has a figure for "
          "these):\n")
    print(figure_blocks.peers_techniques(out, page))
    print("\npredict wall time: " + ", ".join(
        f"{preset} {walls[preset]:.0f} s" if walls[preset] is not None else f"{preset} reused" for preset in results))

    print("\nParameters: membench's model, counted (a tied weight once); accelerate's model; DeepSpeed's largest "
          "layer:\n")
    for preset, (rows, sizes, ds) in results.items():
        base = figure_blocks.row_of(rows, "baseline")
        left_out = sizes["params"] - sizes["accelerate_params"]
        print(f"- {preset}: {sizes['params']:,} parameters (membench's weights category / 4: "
              f"{int(base['predicted_weights_bytes']) // 4:,}); accelerate's AutoModel: "
              f"{sizes['accelerate_params']:,} parameters ({left_out:,} fewer than membench's), "
              f"{sizes['accelerate_weights_fp32']:,} B with its buffers; "
              f"DeepSpeed's largest layer: {sizes['largest_layer_params']:,} parameters")
    print(f"\npredict CSVs and estimators.csv in {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
