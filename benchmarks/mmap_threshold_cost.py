"""What pinning glibc's mmap threshold costs a CPU training step (bench.measure.resident.pin_mmap_threshold), against
glibc's own dynamic threshold: per step the wall time, the process's user and system CPU time, its minor page faults,
and the resident peak above the process at rest (`python -m benchmarks.mmap_threshold_cost --help`; a benchmark, not a
test).

Each setting runs in a fresh process (the threshold, once pinned, stays pinned), alternating, `--rounds` times: one
session of the workload's baseline, one warm-up step, then `--steps` steps each measured alone. A pinned threshold
returns each freed tensor of at least 1 MiB to the system, and the next step's tensors are faulted in (and zeroed by
the kernel) anew: the system time and the page faults are that cost; the resident peak is what it buys.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(workload: str, phase: str, batch: int, steps: int) -> dict:
    """In this process: the medians of `steps` steps of the workload's baseline, and the resident peak over them."""
    from bench.measure import resident
    from bench.run.case import Case, bind_case
    from bench.run.passes import CaseMeter
    from bench.run.session import Session

    resident.pin_mmap_threshold()  # MEMBENCH_MMAP_THRESHOLD=off leaves glibc's own
    resident.warm_libraries()
    resident.release_host_memory()
    rest = resident.current_rss_bytes() or 0
    resident.reset_peak()
    case = Case(workload, "baseline", phase, batch, "cpu")
    strategy, context = bind_case(case)
    strategy.check(context)
    strategy.plan(CaseMeter(case))
    session = Session(case, strategy)
    rows = []
    with strategy.session():
        session.step()
        for _ in range(steps):
            before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            session.step()
            wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
            rows.append((wall, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime,
                         after.ru_minflt - before.ru_minflt))
    wall, user, system, faults = (statistics.median(column) for column in zip(*rows))
    return {"wall_s": wall, "user_s": user, "sys_s": system, "minor_faults": faults,
            "resident_over_rest_bytes": resident.peak_rss_bytes() - rest}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="captcha_resnet18")
    parser.add_argument("--phase", default="train")
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per setting, alternating")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.workload, args.phase, args.batch_size, args.steps)))
        return 0
    command = [sys.executable, "-m", "benchmarks.mmap_threshold_cost", "--child", "--workload", args.workload,
               "--phase", args.phase, "--batch-size", str(args.batch_size), "--steps", str(args.steps)]
    found: dict[str, list[dict]] = {"off": [], "pinned": []}
    print(f"{args.workload} {args.phase} batch {args.batch_size}: {args.rounds} rounds of {args.steps} steps; "
          f"load average {os.getloadavg()}")
    for _ in range(args.rounds):
        for setting in found:
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            if setting == "off":
                env["MEMBENCH_MMAP_THRESHOLD"] = "off"
            else:
                env.pop("MEMBENCH_MMAP_THRESHOLD", None)
            done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, check=True)
            found[setting].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"  {setting:<6} {found[setting][-1]}", flush=True)
    for setting, runs in found.items():
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        print(f"{setting:<6} per step: wall {median['wall_s']:.2f} s, user {median['user_s']:.2f} s, system "
              f"{median['sys_s']:.2f} s, {median['minor_faults']:,.0f} minor faults; resident peak "
              f"{median['resident_over_rest_bytes'] / 2**20:,.0f} MiB over the process at rest")
    print(f"load average {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
