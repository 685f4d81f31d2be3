"""The harness's own memory: for every built-in workload, small, and two Hugging Face models at 2
layers, train and eval, a real `compare` run's counted peak against the process's peak resident memory and the
process at rest, the ratio against the goal, into a CSV (`make harness-memory`; `python -m benchmarks.resident_memory
--help`; a benchmark, not a test: tens of minutes on a 2-core CPU).

Each workload runs as a user runs it: `python -m bench compare --device cpu` in its own process (cases in that one
process, as on the CPU by default), its rows read back from the CSV (`process_peak_rss_bytes`,
`process_rest_rss_bytes`, `peak_mem_bytes`: see bench/measure/resident.py for how each is measured). The goal is
resident <= GOAL_FACTOR x the counted peak + the process at rest, for every case; the ratio written is
(resident - rest) / counted peak.

`--llama` adds `hf:llama-3.2-1b:layers=2:seq_len=128` at batch 2 (an 8 GiB step: it needs about 10 GB resident; it
runs last, and only where MemAvailable is at least LLAMA_FREE_BYTES). `--mmap-threshold off` runs with glibc's own
dynamic mmap threshold instead of the one the harness pins (bench.measure.resident.pin_mmap_threshold), to see what
pinning it changes.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from bench.measure.resident import GOAL_FACTOR, THRESHOLD_VARIABLE, available_bytes, goal_ratio, mmap_threshold_setting

ROOT = Path(__file__).resolve().parents[1]
# (workload spec, batch size, strategies besides the baseline): every built-in workload at a small batch (the models
# suite's, bench/suites/models.yaml), captcha also at its own batch of 100, and gpt2 at 2 layers
WORKLOADS = [
    ("captcha_resnet18", 25, "checkpoint"),
    ("captcha_resnet18", 100, "checkpoint"),
    ("deep_mlp", 256, "checkpoint"),
    ("unet", 16, "checkpoint"),
    ("gpt_mini", 8, "checkpoint"),
    ("timm:resnet18", 8, "checkpoint"),
    ("hf:gpt2:layers=2:seq_len=128", 2, "checkpoint,lora"),
]
LLAMA = ("hf:llama-3.2-1b:layers=2:seq_len=128", 2, "lora")
LLAMA_FREE_BYTES = 14 * 10**9
COLUMNS = ["workload", "batch_size", "strategy", "phase", "status", "mmap_threshold", "peak_mem_bytes",
           "process_peak_rss_bytes", "process_rest_rss_bytes", "harness_rss_bytes", "ratio", "meets_goal",
           "process_rss_method", "step_time_ms_median", "compare_seconds", "load_average_1min", "message"]


def run_compare(workload: str, batch: int, strategies: str, out: Path, extra: list[str], threshold: str | None,
                address_limit_kib: int | None) -> tuple[pd.DataFrame, float, str]:
    """One `compare` run in its own process (under an address-space limit if given); its rows, wall seconds, and
    the last line of its error output where it failed."""
    command = [sys.executable, "-m", "bench", "compare", "--workload", workload, "--strategies", strategies,
               "--device", "cpu", "--batch-size", str(batch), "--warmup", "1", "--steps", "1", "--out", str(out),
               *extra]

    def limit() -> None:
        if address_limit_kib:
            resource.setrlimit(resource.RLIMIT_AS, (address_limit_kib * 1024,) * 2)

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if threshold is not None:
        env[THRESHOLD_VARIABLE] = threshold
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, preexec_fn=limit, cwd=ROOT)
    seconds = time.perf_counter() - started
    files = [f for f in sorted(out.glob("*.csv")) if not f.name.endswith(".timeline.csv")]
    failure = "" if done.returncode == 0 and files else (
        f"compare failed (exit {done.returncode}): {(done.stderr.strip().splitlines() or [''])[-1]}")
    return (pd.read_csv(files[-1]) if files else pd.DataFrame()), seconds, failure


def result_rows(frame: pd.DataFrame, workload: str, batch: int, threshold: str, seconds: float,
                load: float) -> list[dict]:
    """The benchmark's rows of one compare run: the figures of each case and its ratio against the goal."""
    rows = []
    for _, case in frame.iterrows():
        row = {"workload": workload, "batch_size": batch, "strategy": case["strategy"], "phase": case["phase"],
               "status": case["status"], "mmap_threshold": threshold, "compare_seconds": round(seconds, 1),
               "load_average_1min": load, "process_rss_method": case.get("process_rss_method"),
               "message": "" if pd.isna(case.get("message")) else str(case.get("message"))[:200]}
        figures = ("peak_mem_bytes", "process_peak_rss_bytes", "process_rest_rss_bytes", "harness_rss_bytes")
        if case["status"] == "ok" and not any(pd.isna(case.get(c)) for c in figures):
            counted, peak, rest = (int(case[c]) for c in figures[:3])
            ratio = goal_ratio(peak, counted, rest)
            row.update({c: int(case[c]) for c in figures}, ratio=round(ratio, 3), meets_goal=ratio <= GOAL_FACTOR,
                       step_time_ms_median=case.get("step_time_ms_median"))
        rows.append(row)
    return rows


def print_rows(rows: list[dict]) -> None:
    """One line per case: counted peak, resident peak, at rest, harness share, ratio and the goal."""
    mib = 2**20
    for row in rows:
        if row.get("ratio") is None:
            print(f"  {row['strategy']:<12} {row['phase']:<5} {row['status']}: {row['message'][:60]}")
            continue
        print(f"  {row['strategy']:<12} {row['phase']:<5} bs={row['batch_size']:<4} counted "
              f"{row['peak_mem_bytes'] / mib:8.1f} MiB  resident {row['process_peak_rss_bytes'] / mib:8.1f} MiB  "
              f"at rest {row['process_rest_rss_bytes'] / mib:7.1f} MiB  harness {row['harness_rss_bytes'] / mib:7.1f}"
              f" MiB  ratio {row['ratio']:5.2f} {'<=' if row['meets_goal'] else '>'} {GOAL_FACTOR}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", help="comma list of workload specs to run (default: every built-in one)")
    parser.add_argument("--llama", action="store_true", help="also the llama-3.2-1b case, last, if memory allows")
    parser.add_argument("--isolate", action="store_true", help="each case in its own worker process")
    parser.add_argument("--phases", default=None, help="train, eval or train,eval (default: both)")
    parser.add_argument("--mmap-threshold", default=None,
                        help=f"{THRESHOLD_VARIABLE} for the compare runs: bytes, or off for glibc's dynamic one "
                             "(default: the harness's pinned threshold)")
    parser.add_argument("--out", default=str(ROOT / "results" / "harness_memory"),
                        help="folder of the CSV, harness-memory-<time>.csv (default results/harness_memory)")
    parser.add_argument("--address-limit-kib", type=int, default=None,
                        help="RLIMIT_AS of each compare process, in KiB (as `ulimit -v`)")
    args = parser.parse_args(argv)
    chosen = WORKLOADS
    if args.workloads:
        names = args.workloads.split(",")
        chosen = [w for w in WORKLOADS + [LLAMA] if w[0] in names] + [
            (n, 8, "checkpoint") for n in names if n not in {w[0] for w in WORKLOADS + [LLAMA]}]
    threshold = args.mmap_threshold
    if threshold is None:
        setting = mmap_threshold_setting()
        threshold_label = "off" if setting is None else str(setting)
    else:
        threshold_label = threshold
    extra = (["--isolate"] if args.isolate else []) + (["--phases", args.phases] if args.phases else [])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = out / f"harness-memory-{stamp}-{threshold_label}.csv"
    print(f"{socket.gethostname()}: {os.cpu_count()} CPUs, load average {os.getloadavg()}, "
          f"{(available_bytes() or 0) / 1e9:.1f} GB available; mmap threshold {threshold_label}; writing {path}")
    rows: list[dict] = []
    runs = list(chosen) + ([LLAMA] if args.llama and LLAMA not in chosen else [])
    for workload, batch, strategies in runs:
        if workload == LLAMA[0]:
            free = available_bytes() or 0
            if free < LLAMA_FREE_BYTES:
                print(f"{workload}: skipped, {free / 1e9:.1f} GB available < {LLAMA_FREE_BYTES / 1e9:.0f} GB")
                continue
        load = round(os.getloadavg()[0], 2)
        with tempfile.TemporaryDirectory(prefix="membench-rss-") as folder:
            frame, seconds, failure = run_compare(workload, batch, strategies, Path(folder), extra,
                                                  args.mmap_threshold, args.address_limit_kib)
        print(f"{workload} bs={batch} ({strategies}; {seconds:.0f} s, load {load}){': ' + failure if failure else ''}")
        done = result_rows(frame, workload, batch, threshold_label, seconds, load)
        if failure and not done:
            done = [{"workload": workload, "batch_size": batch, "status": "error", "message": failure,
                     "mmap_threshold": threshold_label}]
        print_rows([r for r in done if "strategy" in r])
        rows += done
        pd.DataFrame(rows, columns=COLUMNS).to_csv(path.with_suffix(".tmp"), index=False)
        os.replace(path.with_suffix(".tmp"), path)
    measured = [r for r in rows if r.get("ratio") is not None]
    met = [r for r in measured if r["meets_goal"]]
    print(f"goal (resident <= {GOAL_FACTOR} x counted peak + at rest): met by {len(met)} of {len(measured)} measured "
          f"cases ({len(rows) - len(measured)} without figures); {path}")
    return 0 if measured and len(met) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
