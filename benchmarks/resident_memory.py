"""The harness's own memory (issue 31 §3): for every built-in workload, a real `compare` run's counted peak against the
process's peak resident memory and the process at rest, and the ratio against the goal
(`python -m benchmarks.resident_memory --help`; a benchmark, not a test: minutes on a CPU).

Each workload runs as a user runs it: `python -m bench compare --device cpu --quick` in its own process, its rows
read back from the CSV (`process_peak_rss_bytes`, `process_rest_rss_bytes`, `peak_mem_bytes`: see
bench/measure/resident.py for how each is measured). The goal is resident <= GOAL_FACTOR x the counted peak + the
process at rest, for every case; the ratio printed is (resident - rest) / counted peak.

`--llama` adds `hf:llama-3.2-1b:layers=2:seq_len=128` at batch 2 (an 8 GiB step: it needs about 12 GB free; it
runs last, and only where MemAvailable says there is room).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from bench.measure.resident import GOAL_FACTOR, available_bytes, goal_ratio

ROOT = Path(__file__).resolve().parents[1]
# (workload spec, batch size or None for the workload's own, strategies besides the baseline)
WORKLOADS = [
    ("captcha_resnet18", None, "checkpoint"),
    ("deep_mlp", None, "checkpoint"),
    ("unet", None, "checkpoint"),
    ("gpt_mini", None, "checkpoint"),
    ("timm:resnet18", None, "checkpoint"),
    ("hf:gpt2:layers=2:seq_len=128", 2, "checkpoint,lora"),
]
LLAMA = ("hf:llama-3.2-1b:layers=2:seq_len=128", 2, "checkpoint,lora")
LLAMA_FREE_BYTES = 18 * 10**9


def run_compare(workload: str, batch: int | None, strategies: str, out: Path, extra: list[str],
                address_limit_kib: int | None) -> tuple[pd.DataFrame, float]:
    """One `compare` run in its own process (under an address-space limit if given); its rows and wall seconds."""
    command = [sys.executable, "-m", "bench", "compare", "--workload", workload, "--strategies", strategies,
               "--device", "cpu", "--quick", "--out", str(out), *extra]
    if batch is not None:
        command += ["--batch-size", str(batch)]

    def limit() -> None:
        if address_limit_kib:
            resource.setrlimit(resource.RLIMIT_AS, (address_limit_kib * 1024,) * 2)

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, preexec_fn=limit, cwd=ROOT)
    seconds = time.perf_counter() - started
    files = sorted(out.glob("*.csv"))
    files = [f for f in files if not f.name.endswith(".timeline.csv")]
    if done.returncode != 0 or not files:
        print(f"{workload}: compare failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
        return pd.DataFrame(), seconds
    return pd.read_csv(files[-1]), seconds


def print_rows(frame: pd.DataFrame) -> bool:
    """One line per case: counted peak, resident peak, at rest, harness share, ratio and the goal; whether all meet it."""
    mib = 2**20
    met = True
    for _, row in frame.iterrows():
        if row["status"] != "ok" or pd.isna(row.get("process_peak_rss_bytes")):
            print(f"  {row['strategy']:<12} {row['phase']:<5} {row['status']}: {str(row['message'])[:60]}")
            continue
        counted, peak, rest = (int(row[c]) for c in ("peak_mem_bytes", "process_peak_rss_bytes",
                                                     "process_rest_rss_bytes"))
        ratio = goal_ratio(peak, counted, rest)
        ok = ratio <= GOAL_FACTOR
        met &= ok
        print(f"  {row['strategy']:<12} {row['phase']:<5} bs={int(row['batch_size']):<4} counted {counted / mib:8.1f} "
              f"MiB  resident {peak / mib:8.1f} MiB  at rest {rest / mib:7.1f} MiB  harness "
              f"{int(row['harness_rss_bytes']) / mib:7.1f} MiB  ratio {ratio:5.2f} {'<=' if ok else '>'} "
              f"{GOAL_FACTOR} ({row['process_rss_method']})")
    return met


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", help="comma list of workload specs to run (default: every built-in one)")
    parser.add_argument("--llama", action="store_true", help="also the llama-3.2-1b case, last, if memory allows")
    parser.add_argument("--isolate", action="store_true", help="each case in its own worker process")
    parser.add_argument("--address-limit-kib", type=int, default=None,
                        help="RLIMIT_AS of each compare process, in KiB (as `ulimit -v`)")
    args = parser.parse_args(argv)
    chosen = WORKLOADS
    if args.workloads:
        names = args.workloads.split(",")
        chosen = [w for w in WORKLOADS if w[0] in names] + [(n, None, "checkpoint") for n in names
                                                            if n not in {w[0] for w in WORKLOADS}]
    extra = ["--isolate"] if args.isolate else []
    all_met = True
    runs = list(chosen) + ([LLAMA] if args.llama else [])
    for workload, batch, strategies in runs:
        if (workload, batch, strategies) == LLAMA:
            free = available_bytes() or 0
            if free < LLAMA_FREE_BYTES:
                print(f"{workload}: skipped, {free / 1e9:.1f} GB available < {LLAMA_FREE_BYTES / 1e9:.0f} GB")
                continue
        with tempfile.TemporaryDirectory(prefix="membench-rss-") as folder:
            frame, seconds = run_compare(workload, batch, strategies, Path(folder), extra, args.address_limit_kib)
        print(f"{workload} ({strategies}; {seconds:.0f} s)")
        all_met &= print_rows(frame)
    print(f"goal (resident <= {GOAL_FACTOR} x counted peak + at rest): {'met' if all_met else 'NOT met'} by every case")
    return 0 if all_met else 1


if __name__ == "__main__":
    sys.exit(main())
