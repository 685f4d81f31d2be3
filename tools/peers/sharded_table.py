"""The sharded-training table of docs/peers.md: membench's per-rank prediction beside PyTorch's FSDPMemTracker (run
the torchtitan way, tools/peers/fsdp_mem_tracker.py) and DeepSpeed's ZeRO-3 estimator (its own code,
tools/peers/deepspeed_zero3.py), on the same configurations.

Each configuration is `preset:seq_len:ranks:global_batch`. For each, in turn (one command at a time, each a
subprocess whose output, wall time and load average are kept under --out):
- `python -m bench predict --workload hf:<preset>:seq_len=<S> --device cuda --ranks <N> --global-batch-size <B>
  --strategies fsdp,fsdp+checkpoint:segments=all --phases train` (this Python; the fake-CUDA engine where
  `make cuda-fake-env` has made it);
- tools/peers/fsdp_mem_tracker.py in the fake-CUDA environment's Python, for `fsdp` and `fsdp+checkpoint` (every
  layer), in the variants of --variants: `shipped` (the tracker as torch 2.13.0 ships it, under membench's fake-CUDA
  mode), `plain` (the same under torch's plain FakeTensorMode, exactly as torchtitan enters it), `workaround`
  (DTensor's sharding propagation moved to its own fake mode, so that the tracker skips it as its comment intends);
- tools/peers/deepspeed_zero3.py in --ds-python (an environment with DeepSpeed; skipped, and said, without one).
Then `sharded.csv` (one row per configuration and strategy, bytes) and `runs.csv` (every command, its wall time
and load), and the table in markdown on stdout.

Usage (from the repository root):

    .venv/bin/python tools/peers/sharded_table.py --out results/reference/peers/sharded \\
        --configs llama-3.2-1b:2048:8:8 --ds-python /tmp/ds-venv/bin/python
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GIB = 1024 ** 3
STRATEGIES = {"fsdp": False, "checkpoint:segments=all+fsdp": True}  # membench's row name -> checkpoint every layer
VARIANTS = {"shipped": [], "plain": ["--fake-mode", "plain"], "workaround": ["--propagation-outside"]}
COLUMNS = ("preset", "seq_len", "ranks", "global_batch", "local_batch", "strategy", "membench_allocated_bytes",
           "membench_reserved_bytes", "membench_cublas_workspace_bytes", "membench_weights_bytes",
           "membench_grads_bytes", "membench_optimizer_state_bytes", "membench_activations_bytes",
           "membench_logits_bytes", "membench_other_bytes", "tracker_shipped_bytes", "tracker_plain_bytes",
           "tracker_workaround_bytes", "deepspeed_version", "deepspeed_params", "deepspeed_largest_layer_params",
           "deepspeed_zero3_gpu_bytes")


def parse_config(text: str) -> dict:
    """`preset:seq_len:ranks:global_batch` as a dict."""
    parts = text.split(":")
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        raise argparse.ArgumentTypeError(f"{text!r}: want preset:seq_len:ranks:global_batch")
    preset, seq_len, ranks, batch = parts[0], *map(int, parts[1:])
    return {"preset": preset, "seq_len": seq_len, "ranks": ranks, "global_batch": batch}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="llama-3.2-1b:2048:8:8",
                        help="comma list of preset:seq_len:ranks:global_batch")
    parser.add_argument("--variants", default="shipped,plain,workaround", help="the tracker's variants to run")
    parser.add_argument("--out", required=True, help="folder for every command's output and the CSVs")
    parser.add_argument("--cuda-python", default=str(ROOT / ".venv-cuda-fake" / "bin" / "python"))
    parser.add_argument("--ds-python", default="/tmp/ds-venv/bin/python",
                        help="a Python with DeepSpeed importable (see tools/peers/deepspeed_zero3.py)")
    parser.add_argument("--reuse", action="store_true", help="keep outputs already in --out, run only what is missing")
    args = parser.parse_args(argv)
    try:
        args.configs = [parse_config(c) for c in args.configs.split(",") if c]
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; valid: {', '.join(VARIANTS)}")
    return args


def config_name(config: dict) -> str:
    return f"{config['preset']}-s{config['seq_len']}-r{config['ranks']}-b{config['global_batch']}"


def run(command: list[str], log: Path, runs: list[dict], env: dict | None = None) -> int:
    """Runs `command` in the repository root, its output into `log`; appends its wall time and load to `runs`."""
    print("$", " ".join(command), file=sys.stderr, flush=True)
    load = os.getloadavg()
    start = time.perf_counter()
    with log.open("w") as handle:
        done = subprocess.run(command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, env=env)
    wall = time.perf_counter() - start
    runs.append({"command": " ".join(command).replace(f"{ROOT}/", ""), "output": log.name, "exit": done.returncode,
                 "wall_s": round(wall, 1), "load_1min_at_start": round(load[0], 2),
                 "load_1min_at_end": round(os.getloadavg()[0], 2),
                 "utc_start": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - wall))})
    print(f"  exit {done.returncode}, {wall:.0f} s", file=sys.stderr, flush=True)
    return done.returncode


def membench(config: dict, folder: Path, args, runs: list[dict]) -> list[dict]:
    """membench's predict rows for `config` (run unless --reuse finds them)."""
    found = sorted(folder.glob("predict-*.csv"))
    if not (args.reuse and found):
        command = [sys.executable, "-m", "bench", "predict", "--workload",
                   f"hf:{config['preset']}:seq_len={config['seq_len']}", "--device", "cuda", "--ranks",
                   str(config["ranks"]), "--global-batch-size", str(config["global_batch"]), "--strategies",
                   "fsdp,fsdp+checkpoint:segments=all", "--phases", "train", "--out", str(folder)]
        if run(command, folder / "predict.stdout.txt", runs) != 0:
            raise SystemExit(f"predict failed: see {folder / 'predict.stdout.txt'}")
        found = sorted(folder.glob("predict-*.csv"))
    with found[-1].open(newline="") as handle:
        return list(csv.DictReader(handle))


def tracker(config: dict, strategy: str, variant: str, folder: Path, args, runs: list[dict]) -> dict | None:
    """The tracker's JSON for one strategy and variant (None where it failed)."""
    name = f"tracker-{'checkpoint' if STRATEGIES[strategy] else 'fsdp'}-{variant}"
    result = folder / f"{name}.json"
    if not (args.reuse and result.exists()):
        command = [args.cuda_python, "tools/peers/fsdp_mem_tracker.py", "--workload",
                   f"hf:{config['preset']}:seq_len={config['seq_len']}", "--ranks", str(config["ranks"]),
                   "--batch-size", str(config["global_batch"]), "--json", str(result), *VARIANTS[variant]]
        if STRATEGIES[strategy]:
            command.append("--checkpoint")
        if run(command, folder / f"{name}.stdout.txt", runs) != 0:
            return None
    return json.loads(result.read_text())


def deepspeed(configs: list[dict], folder: Path, args, runs: list[dict]) -> dict:
    """DeepSpeed's rows by (preset, GPUs), or {} where no DeepSpeed Python is there."""
    result = folder / "deepspeed-zero3.json"
    if not (args.reuse and result.exists()):
        if not Path(args.ds_python).exists():
            print(f"no DeepSpeed Python at {args.ds_python}: DeepSpeed's column left empty", file=sys.stderr)
            return {}
        presets = sorted({c["preset"] for c in configs})
        gpus = sorted({c["ranks"] for c in configs})
        live = [p for p in presets if p == "llama-3.2-1b"]  # a real (bfloat16, uninitialised) model: 2.5 GB
        command = [args.ds_python, "tools/peers/deepspeed_zero3.py", "--presets", ",".join(presets), "--gpus",
                   ",".join(map(str, gpus)), "--json", str(result)] + (["--live", ",".join(live)] if live else [])
        env = {**os.environ, "DS_ACCELERATOR": "cpu"}
        if run(command, folder / "deepspeed-zero3.stdout.txt", runs, env=env) != 0:
            return {}
    answer = json.loads(result.read_text())
    return {(r["preset"], r["gpus"]): {**r, "version": answer["deepspeed"]} for r in answer["rows"]}


def gib(value) -> str:
    return "-" if value in (None, "") else f"{int(value) / GIB:.2f}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    rows = []
    for config in args.configs:
        folder = out / config_name(config)
        folder.mkdir(exist_ok=True)
        predicted = membench(config, folder, args, runs)
        for strategy in STRATEGIES:
            mine = next(r for r in predicted if r["strategy"] == strategy and r["phase"] == "train")
            row = {**config, "local_batch": -(-config["global_batch"] // config["ranks"]), "strategy": strategy,
                   "membench_allocated_bytes": mine["predicted_bytes"],
                   "membench_reserved_bytes": mine["predicted_reserved_bytes"],
                   "membench_cublas_workspace_bytes": mine["cublas_workspace_bytes"]}
            for part in ("weights", "grads", "optimizer_state", "activations", "logits", "other"):
                row[f"membench_{part}_bytes"] = mine[f"predicted_{part}_bytes"]
            for variant in args.variants:
                found = tracker(config, strategy, variant, folder, args, runs)
                row[f"tracker_{variant}_bytes"] = found["peak_bytes"] if found else ""
            rows.append(row)
    estimates = deepspeed(args.configs, out, args, runs)
    for row in rows:
        ds = estimates.get((row["preset"], row["ranks"]))
        if ds:
            row.update(deepspeed_version=ds["version"], deepspeed_params=ds["params"],
                       deepspeed_largest_layer_params=ds["largest_layer_params"],
                       deepspeed_zero3_gpu_bytes=ds["zero3_gpu_bytes_no_offload"])
    with (out / "sharded.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, restval="")
        writer.writeheader()
        writer.writerows(rows)
    if runs:  # appended: a --reuse run adds the commands it ran to those of the first
        path = out / "runs.csv"
        new = not path.exists()
        with path.open("a", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=("utc_start", "command", "output", "exit", "wall_s",
                                                        "load_1min_at_start", "load_1min_at_end"))
            if new:
                writer.writeheader()
            writer.writerows(runs)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs\n")
    print("| configuration | membench allocated / reserved | FSDPMemTracker as shipped | with the workaround | "
          "DeepSpeed ZeRO-3 model states |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['preset']} seq {row['seq_len']}, {row['ranks']} ranks, global batch {row['global_batch']}, "
              f"`{row['strategy']}` | {gib(row['membench_allocated_bytes'])} / {gib(row['membench_reserved_bytes'])} "
              f"| {gib(row.get('tracker_shipped_bytes'))} | {gib(row.get('tracker_workaround_bytes'))} | "
              f"{gib(row.get('deepspeed_zero3_gpu_bytes'))} |")


if __name__ == "__main__":
    main()
