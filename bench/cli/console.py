"""What the CLI prints to the console: the table of a run, its progress lines, and the announcement before it."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import pandas as pd

from bench.core.results import Status
from bench.core.units import MiB
from bench.measure.stats import NOISE_THRESHOLD
from bench.run.case import full_workload_spec
from bench.run.eta import duration, emulation_warning

RELATIVE_FORMAT = "{:.2f}x"


def status(text: str) -> None:
    """A progress line on stderr."""
    print(text, file=sys.stderr, flush=True)


def finish_run(frame, path: Path) -> int:
    """Prints the table and the file; exit status 1 when no case succeeded (every row oom, unsupported, error)."""
    print(format_table(frame))
    print(f"\nwrote {path}")
    if frame.empty or not (frame["status"] == Status.OK).any():
        counts = ", ".join(f"{n} {status}" for status, n in frame["status"].value_counts().items())
        print(f"error: no case succeeded ({counts or 'no rows'}); the message column of {path} says why",
              file=sys.stderr)
        return 1
    print(f"charts: python -m bench report {shlex.quote(str(path))}")
    return 0


def format_table(frame) -> str:
    """The console table: per workload, one line per case, memory and time relative to that workload's baseline;
    pitfalls (and the baseline's eval, autograd left on) apart, with the memory each adds per step."""
    header = f"{'strategy':<32} {'phase':<5} {'batch':>5} {'peak MiB':>9} {'vs base':>7} " \
             f"{'step ms':>9} {'± IQR':>7} {'95% CI ms':>15} {'vs base':>7} {'matches':>7}  status"
    lines = []
    any_noisy = False
    for (workload, data), rows in frame.groupby(["workload", "data"], sort=False, dropna=False):
        if lines:
            lines.append("")
        lines += [f"workload {workload} (data {data})", header, "-" * len(header)]
        pitfall = rows["strategy_role"] == "pitfall"  # as the strategy declared it
        for _, r in rows[~pitfall].iterrows():
            line, noisy = _table_line(r)
            lines.append(line)
            any_noisy |= noisy
        eval_baseline = rows[(rows["strategy"] == "baseline") & (rows["phase"] == "eval")]
        if pitfall.any() or not eval_baseline.empty:
            lines.append("pitfalls (what each costs; growth = live bytes added per step; the baseline's eval "
                         "leaves autograd on, fix: no_grad_eval):")
            for _, r in pd.concat([eval_baseline, rows[pitfall]]).iterrows():
                line, noisy = _table_line(r)
                growth = r.get("mem_growth_bytes_per_step")
                lines.append(line + (f"  growth {growth:,.0f} B/step" if _is_number(growth) else ""))
                any_noisy |= noisy
    if any_noisy:
        lines.append(f"~ noisy: the 95% CI of the step time is wider than {NOISE_THRESHOLD:.0%} of the median")
    if "emulated_16bit" in frame and (frame["emulated_16bit"].astype(str).str.lower() == "true").any():
        emulated = frame.loc[frame["emulated_16bit"].astype(str).str.lower() == "true", "strategy"]
        lines.append(f"{', '.join(dict.fromkeys(map(str, emulated)))}: 16-bit autocast that this CPU emulates in "
                     "float32 (no native instructions; `python -m bench env`): their times are this CPU's emulation, "
                     "not what 16-bit arithmetic costs")
    lines += _rank_lines(frame)
    if {"peak_mem_spread_bytes", "repeats"} <= set(frame.columns) and (pd_num(frame["repeats"]) > 1).any():
        spread = pd_num(frame["peak_mem_spread_bytes"]).where(frame["status"] == Status.OK)
        differ = frame.loc[spread > 0, "strategy"].tolist()
        lines.append("peak bytes across repeats: " + (f"DIFFER for {', '.join(map(str, differ))}" if differ
                                                     else "identical in every ok row (spread 0 B)"))
    return "\n".join(lines)


RANK_BREAKDOWN = ("params", "grads", "optimizer", "activations", "temp")


def _rank_lines(frame) -> list[str]:
    """For sharded cases: the ranks' peaks and what the largest rank's peak is made of (MiB)."""
    if "ranks" not in frame or not (pd_num(frame["ranks"]) > 1).any():
        return []
    header = (f"{'sharded case':<32} {'phase':<5} {'ranks':>5} {'max rank':>9} {'min rank':>9}  "
              + " ".join(f"{name:>11}" for name in RANK_BREAKDOWN))
    lines = ["", "per rank (MiB; the breakdown is the largest rank's):", header, "-" * len(header)]
    for _, r in frame[(pd_num(frame["ranks"]) > 1) & (frame["status"] == Status.OK)].iterrows():
        parts = [r.get(f"peak_{name}_bytes") for name in RANK_BREAKDOWN]
        lines.append(f"{r['strategy']:<32} {r['phase']:<5} {int(r['ranks']):>5} "
                     f"{r['rank_peak_max_bytes'] / MiB:>9.1f} {r['rank_peak_min_bytes'] / MiB:>9.1f}  "
                     + " ".join(f"{(v or 0) / MiB:>11.1f}" for v in parts))
    return lines


def _table_line(r) -> tuple[str, bool]:
    """One case's line of the console table, and whether its step time is noisy."""
    def num(value, fmt):
        return fmt.format(value) if value == value and value is not None else "-"
    mib = r["peak_mem_bytes"] / MiB if r["status"] == Status.OK else float("nan")
    match = {True: "yes", False: "NO"}.get(r["matches_baseline"], "-")
    status = r["status"] if r["status"] == Status.OK else f"{r['status']}: {r['message']}"
    noisy = r.get("noisy") is True or str(r.get("noisy")).lower() == "true"
    noisy = noisy and r["status"] == Status.OK
    step = num(r["step_time_ms_median"], "{:.1f}") + ("~" if noisy else "")
    return (f"{r['strategy']:<32} {r['phase']:<5} {r['batch_size']:>5} {num(mib, '{:.1f}'):>9} "
            f"{num(r['mem_vs_baseline'], RELATIVE_FORMAT):>7} {step:>9} "
            f"{num(r['step_time_ms_iqr'], '{:.1f}'):>7} {_ci(r):>15} "
            f"{num(r['time_vs_baseline'], RELATIVE_FORMAT):>7} {match:>7}  {status}"), noisy


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and value == value


def pd_num(column):
    """The column as numbers, 0 where empty or not a number."""
    return pd.to_numeric(column, errors="coerce").fillna(0)


def _ci(r) -> str:
    low, high = r.get("step_time_ms_ci95_low"), r.get("step_time_ms_ci95_high")
    if low is None or high is None or low != low or high != high or r["status"] != Status.OK:
        return "-"
    return f"[{low:.1f}, {high:.1f}]"


class Progress:
    """The progress lines of a run on stderr: each case as it starts and ends, with the time elapsed and an
    estimate of the time left (bench.run.eta), a note before a case whose 16-bit arithmetic the CPU emulates, and,
    within a case, the pass and step being run (bench.core.progress).

    On a terminal the step line is rewritten in place; in a log, a step line at most every `LOG_INTERVAL_S`."""

    LOG_INTERVAL_S = 15.0

    def __init__(self, stream=None, estimate=None, cpu: str = "this CPU"):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.estimate = estimate  # a bench.run.eta.SweepEstimate, or None: the mean finished case stands for the rest
        self.cpu = cpu
        self.started = time.monotonic()
        self.case_started = self.started
        self.running: int | None = None
        self.prefix = ""
        self.partial = False
        self.last_step_line = 0.0

    def _print(self, text: str) -> None:
        if self.partial:
            self.stream.write("\r\033[K")
            self.partial = False
        print(text, file=self.stream, flush=True)

    def _left(self, now: float, index: int, total: int) -> float | None:
        """Seconds left in the sweep: bench.run.eta's estimate, else the mean finished case times the cases left."""
        if self.estimate is not None:
            return self.estimate.seconds_left(self.running, now - self.case_started)
        return (now - self.started) / (index + 1) * (total - index - 1)

    def step(self, what: str, done: int, total: int) -> None:
        """A bench.core.progress listener; `total` 0: a count not known in advance (adaptive timing)."""
        now = time.monotonic()
        left = self.estimate.seconds_left(self.running, now - self.case_started) if self.estimate else None
        text = f"{self.prefix}: {what}" + (f" step {done}/{total}" if total > 1 else f" step {done}" if total == 0
                                           else "") + f" ({duration(now - self.case_started)} into the case" + \
            (f"; sweep about {duration(left)} left)" if left is not None else ")")
        if self.tty:
            self.stream.write("\r\033[K" + text)
            self.stream.flush()
            self.partial = True
        elif now - self.last_step_line >= self.LOG_INTERVAL_S and now - self.case_started >= self.LOG_INTERVAL_S:
            self._print(text)
            self.last_step_line = now

    def case(self, index: int, total: int, case, row) -> None:
        """run_cases' progress callback."""
        self.prefix = f"[{index + 1:>{len(str(total))}}/{total}] {case.label()}"
        if row is None:
            self.case_started = self.last_step_line = time.monotonic()
            self.running = index
            self._print(f"{self.prefix} ...")
            if self.estimate is not None and index in self.estimate.emulated:
                self._print("  " + emulation_warning(case, self.estimate.emulated[index], self.cpu,
                                                     self.estimate.baseline_step_ms(case)))
            return
        now = time.monotonic()
        if self.estimate is not None:
            self.estimate.finished(index, now - self.case_started, row)
        self.running = None
        elapsed = now - self.started
        left = self._left(now, index, total) if total - index - 1 else None
        timing = f"  ({duration(elapsed)} elapsed" + (f", about {duration(left)} left)" if left else ")")
        if row["status"] != Status.OK:
            self._print(f"{self.prefix}: {row['status']} {row['message']}{timing}")
            return
        mib = row["peak_mem_bytes"] / MiB
        match = "  DOES NOT MATCH BASELINE" if row.get("matches_baseline") is False else ""
        steps = f" ({row['measured_steps']} steps, {row['timing_stop_reason']})" if row.get("timing_stop_reason") \
            else ""
        self._print(f"{self.prefix}: {row['step_time_ms_median']:.1f} ms/step{steps}, peak {mib:.1f} MiB{match}"
                    f"{timing}")



def announce(cases, out_path: Path, resumed: bool, quick_with: tuple[str, ...] = (),
             first_case: str | None = None) -> None:
    """Before the first case: how many cases, how many steps each, where the results go, and how to be quick.
    `quick_with`: the adaptive-timing options given beside --quick, which replace its 3 fixed measured steps;
    `first_case`: how long the first case will take (bench.run.eta.first_case_note), if known."""
    if not cases:
        print(f"nothing left to run in {out_path}", file=sys.stderr, flush=True)
        return
    workloads = list(dict.fromkeys(full_workload_spec(c.workload) for c in cases))
    per_case = "; ".join(dict.fromkeys(timing_text(c) for c in cases))
    print(f"{'resuming' if resumed else 'running'} {len(cases)} case(s) of {', '.join(workloads)} on "
          f"{cases[0].device}, {per_case} (plus a verification and a memory pass), into "
          f"{out_path}", file=sys.stderr, flush=True)
    if quick_with:
        print(f"  note: {' and '.join(quick_with)} win{'s' if len(quick_with) == 1 else ''} over --quick's 3 "
              f"measured steps: {timing_text(cases[0])}; drop {' and '.join(quick_with)} for --quick's 3 steps",
              file=sys.stderr, flush=True)
    if first_case:
        print(f"  {first_case}", file=sys.stderr, flush=True)
    elif not quick_with and cases[0].device == "cpu" and any((c.steps or c.min_steps) > 3 or c.warmup > 1
                                                             for c in cases):
        print("  a CPU step at a full batch can take seconds: --quick (1 warm-up + 3 measured steps) or a "
              "smaller --batch-size gives a first look in minutes; the time left is shown after each case",
              file=sys.stderr, flush=True)


def timing_text(case) -> str:
    """How a case is timed, in words: a fixed count, or adaptive timing with its options."""
    if case.steps is not None:
        return f"{case.warmup} warm-up + {case.steps} measured steps each"
    return (f"{case.warmup} warm-up + at least {case.min_steps} measured step(s) each, until the median's 95% "
            f"interval is within {case.target_ci_rel:.0%} of it or after {case.max_time_s:g} s of timed steps")
