"""How long membench takes to answer "does it fit" (its speed goals): `make perf-predict`, or
`python -m benchmarks.perf_predict [--only NAME,...] [--list]`.

Each goal is timed as a user meets it, wall-clock: `cold` goals are a new `python -m bench ...` process (its
fake-CUDA worker included); the `warm` goal is a second prediction in the same fake-CUDA process, at another length.
One line per goal: its name, seconds, the goal's seconds, the machine's load average (1 minute) at its start and end,
and the figures it predicted (bytes; for fit the lengths, for plan a digest of every candidate's judged bytes and the
answer), so that a run after a speed-up shows that no figure moved. The figures are only comparable on the same
machine under similar load: the goals are for a quiet 2-core machine.

membench's own modules are compiled to bytecode first, as every run after an install's first finds them (pip
compiles what it installs; Python writes the rest on first import). A machine that sets PYTHONDONTWRITEBYTECODE (this
one does) would otherwise compile about 200 of them from source in every goal's process: 0.1 s a process.
"""

from __future__ import annotations

import argparse
import compileall
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bench", "strategies", "workloads")
LLAMA_8B = "hf:llama-3.1-8b:seq_len=4096"
LLAMA_70B = "hf:llama-3.1-70b:seq_len=4096"


@dataclass(frozen=True)
class Goal:
    """One speed goal: the `python -m bench` arguments it times (or "warm"), and its goal in seconds."""

    name: str
    goal_s: float
    argv: tuple[str, ...]


def _predict(workload: str, strategy: str, batch: int, *extra: str) -> tuple[str, ...]:
    return ("predict", "--workload", workload, "--device", "cuda", "--batch-size", str(batch), "--phases", "train",
            "--strategies", strategy, *extra)


FIT_STRATEGIES = "lora+checkpoint,qlora+checkpoint,qlora+checkpoint+chunked_loss"
GOALS = (
    Goal("predict-8b-lora", 5, _predict(LLAMA_8B, "lora+checkpoint", 1)),
    Goal("predict-8b-qlora", 5, _predict(LLAMA_8B, "bf16_weights+qlora+checkpoint", 1)),
    Goal("warm-8b-lora", 2, ("warm",)),
    Goal("predict-8b-compile", 15, _predict(LLAMA_8B, "lora+checkpoint+compile:scope=layers:loss=true", 1)),
    Goal("predict-70b-fsdp-8ranks", 10, _predict(LLAMA_70B, "fsdp+checkpoint", 8, "--ranks", "8")),
    Goal("predict-captcha", 2, ("predict", "--device", "cuda", "--batch-size", "100", "--phases", "train")),
    Goal("fit-8b-seq_len-4090", 60, ("fit", "--workload", "hf:llama-3.1-8b", "--gpu", "RTX 4090", "--over", "seq_len",
                                     "--batch-size", "1", "--strategies", FIT_STRATEGIES)),
    Goal("plan-8b-h100", 60, ("plan", "--workload", LLAMA_8B, "--gpu", "H100 80GB")),
    Goal("plan-70b-max-ranks-8", 120, ("plan", "--workload", LLAMA_70B, "--gpu", "H100 80GB", "--max-ranks", "8",
                                       "--global-batch-size", "8")),
)

# the warm goal: two lengths predicted one after the other in one fake-CUDA process, the second one timed; layer
# replay's worker stood by first, as `python -m bench predict` does before it reads the workload (a Case reads it,
# which asks torch about CUDA: a worker forked after that could not use CUDA)
WARM_SCRIPT = """
import sys, time
from bench.analysis import predict, proof_beside
from bench.run.case import Case
proof_beside.stand_by("hf:llama-3.1-8b:seq_len=4096")
times, figures = [], []
for seq_len in (4096, 2048):
    case = Case(f"hf:llama-3.1-8b:seq_len={seq_len}", "lora+checkpoint", "train", 1, "cuda")
    start = time.perf_counter()
    (row,) = predict.predict_cases([case])
    times.append(time.perf_counter() - start)
    figures.append(f"seq_len={seq_len}: {row['predicted_bytes']}/{row['predicted_reserved_bytes']} B")
print(f"{times[1]:.1f}", "; ".join(figures) + f" (first {times[0]:.1f} s)")
"""


def _figures(kind: str, folder: Path) -> str:
    """The figures a run wrote into `folder` (its CSV), in one line."""
    written = sorted(folder.glob(f"{kind}-*.csv"))
    if not written:
        return "no CSV written"
    table = pd.read_csv(written[-1], comment="#")
    if kind == "predict":
        return "; ".join(f"{r.strategy}={r.predicted_bytes:.0f}/{r.predicted_reserved_bytes:.0f} B"
                         if r.status == "ok" else f"{r.strategy}={r.status}" for r in table.itertuples())
    if kind == "fit":
        return "; ".join(f"{r.strategy}: seq_len {r.seq_len} judged {r.judged_bytes:.0f} next {r.next_judged_bytes:.0f}"
                         for r in table.itertuples())
    ok = table[table["status"] == "ok"]
    evaluated = ok[ok["judged_bytes"].notna()]  # the others were stopped as certain not to fit (no figure)
    stopped = len(ok) - len(evaluated)
    pairs = ",".join(f"{r.ranks}:{r.strategy}:{r.judged_bytes:.0f}" for r in evaluated.itertuples())
    answer = table[table["answer"].fillna(False).astype(str) == "True"] if "answer" in table else table.iloc[:0]
    chosen = "; ".join(f"{r.answer} {r.strategy} ({r.ranks} ranks) {r.judged_bytes:.0f}" for r in answer.itertuples())
    return (f"{len(evaluated)} of {len(table)} candidates predicted to the end, {stopped} stopped as certain not "
            f"to fit, judged digest "
            f"{hashlib.sha256(pairs.encode()).hexdigest()[:12]}; {chosen or 'no answer'}")


def run_goal(goal: Goal, python: str) -> tuple[float, str]:
    """(wall seconds, figures) of one goal."""
    if goal.argv == ("warm",):
        fake = ROOT / ".venv-cuda-fake" / "bin" / "python"
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        done = subprocess.run([str(fake), "-c", WARM_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            return float("nan"), "failed: " + done.stderr.strip().splitlines()[-1][:200]
        seconds, figures = done.stdout.strip().splitlines()[-1].split(" ", 1)
        return float(seconds), figures
    with tempfile.TemporaryDirectory(prefix="perf-predict-") as folder:
        start = time.perf_counter()
        done = subprocess.run([python, "-m", "bench", *goal.argv, "--out", folder], cwd=ROOT, capture_output=True,
                              text=True)
        seconds = time.perf_counter() - start
        if done.returncode == 1 and goal.argv[0] == "plan":  # nothing fits: the plan's answer, its CSV written
            return seconds, "exit 1 (no candidate fits): " + _figures("plan", Path(folder))
        if done.returncode != 0:
            return seconds, f"exit {done.returncode}: " + (done.stderr.strip().splitlines() or [""])[-1][:200]
        return seconds, _figures(goal.argv[0], Path(folder))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated goal names (default: all); --list names them")
    parser.add_argument("--list", action="store_true", help="print the goals and their commands")
    args = parser.parse_args(argv)
    chosen = GOALS
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in {g.name for g in GOALS}]
        if unknown:
            print(f"error: unknown goal {unknown[0]!r}; valid choices: {', '.join(g.name for g in GOALS)}",
                  file=sys.stderr)
            return 2
        chosen = tuple(g for g in GOALS if g.name in names)
    if args.list:
        for goal in chosen:
            print(f"{goal.name:26s} <= {goal.goal_s:g} s: python -m bench {' '.join(goal.argv)}")
        return 0
    for package in PACKAGES:  # the bytecode every run after the first finds (see the module docstring)
        compileall.compile_dir(ROOT / package, quiet=1)
    print(f"{'goal':26s} {'seconds':>8s} {'goal':>6s}  load  figures", flush=True)
    for goal in chosen:
        load_before = os.getloadavg()[0]
        seconds, figures = run_goal(goal, sys.executable)
        load = f"{load_before:.1f}-{os.getloadavg()[0]:.1f}"
        print(f"{goal.name:26s} {seconds:8.1f} {goal.goal_s:6g}  {load}  {figures}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
