"""`python -m bench {list,env,run,compare,report,explain,predict,fit}`: one `cmd_<name>` function per subcommand.

The CLI parses, checks every value before anything runs (bench.run.preflight), dispatches and prints.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from bench.core.errors import UsageError, choices_error

RELATIVE_FORMAT = "{:.2f}x"
DEFAULT_WORKLOAD = "captcha_resnet18"
WORKLOAD_HELP = ("a registered workload with options (see `list`; e.g. deep_mlp:layers=100, timm:resnet18) or your own: "
                 "path/to/file.py:NAME or package.module:NAME; default captcha_resnet18")
# Where a user's own runs go. The committed reference runs live under results/reference/ and are never a default
# output, so that no command of a user rewrites them.
DEFAULT_OUT = "runs"
DESCRIPTION = ("Measures what each PyTorch memory-saving technique saves and costs (peak memory, step time, whether "
               "the result still matches the baseline) on a model you choose, on this machine. Results go to "
               f"{DEFAULT_OUT}/ unless --out says otherwise; `python -m bench <command> --help` for each command.")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2 (no usage dump)."""

    def error(self, message: str):
        raise UsageError(message)


# --- argument helpers ----------------------------------------------------------------------------------

def _batch_sizes(text: str, option: str = "--batch-size") -> list[int]:
    """`100` or `25,50,100` -> positive integers; anything else is a UsageError naming the bad part."""
    sizes = []
    for part in str(text).split(","):
        try:
            sizes.append(_positive_int(part))
        except argparse.ArgumentTypeError:
            raise UsageError(f"{option}: bad batch size {part.strip()!r}; a batch size must be a positive "
                             "integer (e.g. 100 or 25,50,100)") from None
    return sizes


def _csv_list(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _add_case_options(p: argparse.ArgumentParser) -> None:
    from bench.run.preflight import DEFAULT_MAX_TIME_PER_CASE_S, DEFAULT_MIN_STEPS, DEFAULT_TARGET_CI, DEFAULT_WARMUP_STEPS

    p.add_argument("--workload", default=None, help=WORKLOAD_HELP)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto: cuda if there is a GPU)")
    p.add_argument("--batch-size", default=None, help="one size or a comma list, e.g. 25,50,100 (default: the "
                                                       "workload's own, 100 for captcha_resnet18; see `list`)")
    p.add_argument("--phases", default=None, help="train,eval, train or eval (default train,eval)")
    p.add_argument("--steps", type=_positive_int, default=None,
                   help="exactly N timed steps per case (default: adaptive timing, see --min-steps; or the suite's)")
    p.add_argument("--warmup", type=_non_negative_int, default=None,
                   help=f"warm-up steps before timing (default {DEFAULT_WARMUP_STEPS}, or the suite's)")
    p.add_argument("--min-steps", type=_positive_int, default=None,
                   help=f"adaptive timing: time at least N steps, then stop once the median's 95%% confidence "
                        f"interval is within --target-ci or --max-time-per-case is spent (default "
                        f"{DEFAULT_MIN_STEPS}, or the suite's)")
    p.add_argument("--max-time-per-case", type=_positive_float, default=None, metavar="SECONDS",
                   help=f"adaptive timing: stop after this many seconds of timed steps, per case and repeat (the "
                        f"step that crosses it finishes; default {DEFAULT_MAX_TIME_PER_CASE_S:g}, or the suite's)")
    p.add_argument("--target-ci", type=_fraction, default=None, metavar="FRACTION",
                   help=f"adaptive timing: stop once the 95%% interval of the median is narrower than this "
                        f"fraction of it (default {DEFAULT_TARGET_CI:g}, i.e. about +-2.5%%; or the suite's)")
    p.add_argument("--data", default=None, help="a data source of the workload (see `list`), e.g. captcha (real "
                                                 "images) or synthetic (random tensors); default the workload's first")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"folder for the results CSV (default {DEFAULT_OUT}/)")
    p.add_argument("--quick", action="store_true", help="1 warm-up step and 3 measured steps: a first look in "
                                                        "minutes on a CPU (default off)")
    _add_sweep_options(p)


def _number_type(convert: Callable[[str], Any], valid: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """An argparse type: `convert(text)`, refused unless `valid`; argparse reports the error (an
    ArgumentTypeError) in one line with the option's name."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not valid(value):
            raise argparse.ArgumentTypeError(f"bad value {text!r}; expected {expected}")
        return value
    return parse


_positive_int = _number_type(int, lambda v: v > 0, "a positive integer")
_positive_float = _number_type(float, lambda v: 0 < v < float("inf"), "a positive number of seconds")
_fraction = _number_type(float, lambda v: 0 < v < 1, "a fraction between 0 and 1 (e.g. 0.05)")  # --target-ci
_non_negative_int = _number_type(int, lambda v: v >= 0, "0 or a positive integer")


def _add_sweep_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="run each case (and each repeat) in a fresh Python process (default: on for cuda, "
                        "off for cpu); --no-isolate runs in this process with process-wide flags restored")
    p.add_argument("--repeats", type=_positive_int, default=1,
                   help="repeat each case's timing and memory passes K times; adds a 95%% CI and a noisy flag "
                        "(default 1)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch.set_num_threads for every case (default: torch's default here, "
                        "usually the physical cores); recorded in cpu_threads")
    p.add_argument("--deterministic", action="store_true",
                   help="cudnn.deterministic and torch.use_deterministic_algorithms(True) for each case (default off)")
    p.add_argument("--ranks", type=_positive_int, default=1,
                   help="processes of torch.distributed for the sharded strategies ddp, zero1, fsdp (gloo on the CPU, "
                        "NCCL and one GPU each on CUDA); each gets 1/N of the batch (default 1)")
    p.add_argument("--executor", default=None,
                   help="where the cases run: local (default: this machine, in order) or ray (each case and repeat a "
                        "task in a fresh Ray worker process; see --ray-address)")
    p.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="the Ray cluster for --executor ray (auto, ray://head:10001, head:6379); default: start a "
                        "local Ray bound to 127.0.0.1 for the sweep")
    p.add_argument("--resume", default=None, metavar="CSV",
                   help="continue the run in this results CSV: skip its finished cases, run the rest into it "
                        "(default: a new CSV in --out)")


EXECUTORS = ("local", "ray")


def _run_options(args, device: str, suite=None, memory_fraction: float | None = None):
    """The run's options; `--executor` and `--ray-address` fall back to the suite file's `executor`/`ray_address`.
    `memory_fraction`: the cap `--memory-limit` set here (`apply_memory_limit`), for the worker processes."""
    from bench.run.isolation import RunOptions

    executor = _check_choice("executor", args.executor or getattr(suite, "executor", None) or "local", EXECUTORS)
    isolate = args.isolate if getattr(args, "isolate", None) is not None else device == "cuda"
    return RunOptions(isolate=isolate or executor == "ray", repeats=getattr(args, "repeats", 1),
                      threads=getattr(args, "threads", None), deterministic=getattr(args, "deterministic", False),
                      executor=executor, ranks=getattr(args, "ranks", 1), memory_fraction=memory_fraction)


def _executor(args, options, suite=None):
    """The runner's executor for `options.executor` (bench.run.runner.local_executor, or a RayExecutor)."""
    from bench.run.runner import local_executor

    if options.executor != "ray":
        if args.ray_address:
            raise UsageError("--ray-address needs --executor ray")
        return local_executor
    from bench.run.ray_executor import RayExecutor, import_ray

    import_ray()  # a missing package is an error before any case
    return RayExecutor(args.ray_address or getattr(suite, "ray_address", None))


def _suite_from_args(args, device: str, strategies: list[str] | None):
    """The suite to run: the suite file if given, with any command-line option taking precedence. Every value is
    checked here, before anything runs; a bad one is a UsageError that names its option."""
    from bench.run.suite import Suite, check_data, load_suite, validate
    from strategies import PHASES
    from workloads import get_workload

    suite = load_suite(args.suite, device) if getattr(args, "suite", None) else Suite()
    overrides = {}
    if strategies is not None:
        overrides["strategies"] = strategies
        try:
            validate({"strategies": strategies}, "--strategies")
        except UsageError as error:
            raise UsageError(str(error).replace("--strategies: key 'strategies':", "--strategies:")) from None
    if args.workload:
        overrides["workloads"] = _csv_list(args.workload)
        for spec in overrides["workloads"]:
            try:
                get_workload(spec)
            except UsageError as error:
                raise UsageError(f"--workload: {error}") from None
    if args.data:
        overrides["data"] = args.data
    if args.phases:
        overrides["phases"] = [_check_choice("phase", p, PHASES, "--phases") for p in _csv_list(args.phases)]
    if args.batch_size:
        overrides["batch_sizes"] = _batch_sizes(args.batch_size)
    adaptive = {key: value for key, value in (("min_steps", args.min_steps), ("max_time_per_case",
                                                                           args.max_time_per_case),
                                               ("target_ci", args.target_ci)) if value is not None}
    if args.steps is not None and adaptive:
        raise UsageError(f"--steps {args.steps} fixes the number of timed steps; --{next(iter(adaptive)).replace('_', '-')}"
                         " is for adaptive timing: give one or the other")
    if args.quick:
        overrides.update(warmup=1, **({} if adaptive else {"steps": 3}))
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.warmup is not None:
        overrides["warmup"] = args.warmup
    overrides.update(adaptive)
    validate(overrides, "command line")
    for key, value in overrides.items():
        setattr(suite, key, value)
    if adaptive:
        suite.steps = None
        for entry in suite.workloads:
            entry.pop("steps", None)
    if args.data:
        for entry in suite.workloads:
            try:
                get_workload(entry["workload"]).check_data(args.data)
            except UsageError as error:
                raise UsageError(f"--data: {error}") from None
    return check_data(suite, "command line")


def _check_steps(cases, args) -> None:
    """Step counts within bench.run.preflight's limits, named by the option (or suite key) that set them."""
    from bench.run.preflight import check_steps

    for case in {(c.warmup, c.steps, c.min_steps): c for c in cases}.values():
        check_steps(case.steps, "--steps" if args.steps is not None else "the suite's steps", 1)
        check_steps(case.warmup, "--warmup" if args.warmup is not None else "the suite's warmup", 0)
        check_steps(case.min_steps, "--min-steps" if args.min_steps is not None else "the suite's min_steps", 1)


# A run holds more than one step's live tensors: the verification keeps the baseline's result (outputs, gradients)
# beside the strategy's, and the batch is cached between passes. Twice the step's peak covers what we have seen.
RUN_MEMORY_FACTOR = 2
MEMORY_PROBE_BATCH = 64


def _check_memory(cases) -> None:
    """On the CPU: for each workload and phase, whether its largest batch fits in this machine's memory.

    The need is the baseline's exact tracked peak on the meta device (no memory used): at the batch itself up to
    twice `MEMORY_PROBE_BATCH`, else extrapolated linearly from that batch and its double (at small batches the
    peak is Adam's step, whose size does not grow with the batch, so a slope from batches 1 and 2 is far too
    low). More than the machine's memory is an error before anything runs (the system would kill the run);
    more than its share once verification is counted, a warning."""
    from dataclasses import replace

    from bench.analysis import predict
    from bench.core.units import format_size
    from bench.run import preflight

    memory = preflight.machine_memory_bytes()
    if memory is None:
        return
    largest: dict[tuple, object] = {}
    for case in cases:
        if case.device == "cpu":
            key = (case.workload, case.phase, case.data)
            if key not in largest or case.batch_size > largest[key].batch_size:
                largest[key] = case
    for case in largest.values():
        def peak_at(batch: int) -> int:
            return predict.tracked_peak(replace(case, batch_size=batch, strategy="baseline"), "baseline",
                                        engine="meta", block_bytes=1)

        low, high = MEMORY_PROBE_BATCH, 2 * MEMORY_PROBE_BATCH
        try:
            if case.batch_size <= high:
                need, per_sample = peak_at(case.batch_size), None
            else:
                at_low, at_high = peak_at(low), peak_at(high)
                per_sample = max((at_high - at_low) / (high - low), 1.0)
                need = int(at_high + per_sample * (case.batch_size - high))
        except Exception:  # noqa: BLE001 - a model meta cannot run: no estimate, no check
            continue
        what = (f"--batch-size {case.batch_size} of {case.workload} ({case.phase}) needs about {format_size(need)} "
                f"for one baseline step")
        if need > memory:
            hint = (f"; give a batch size below {int(case.batch_size - (need - memory) / per_sample):,}"
                    if per_sample else "")
            raise UsageError(f"{what}, more than this machine's {format_size(memory)} of memory{hint}")
        if need * RUN_MEMORY_FACTOR > memory:
            preflight.warn(f"{what}, and a run holds up to {RUN_MEMORY_FACTOR}x that: more than this machine's "
                           f"{format_size(memory)} of memory; expect `oom` rows, or the system ending the run")


def _duration(seconds: float) -> str:
    from bench.run.eta import duration

    return duration(seconds)


class _Progress:
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
                                           else "") + f" ({_duration(now - self.case_started)} into the case" + \
            (f"; sweep about {_duration(left)} left)" if left is not None else ")")
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
                from bench.run.eta import emulation_warning

                self._print("  " + emulation_warning(case, self.estimate.emulated[index], self.cpu,
                                                     self.estimate.baseline_step_ms(case)))
            return
        now = time.monotonic()
        if self.estimate is not None:
            self.estimate.finished(index, now - self.case_started, row)
        self.running = None
        elapsed = now - self.started
        left = self._left(now, index, total) if total - index - 1 else None
        timing = f"  ({_duration(elapsed)} elapsed" + (f", about {_duration(left)} left)" if left else ")")
        if row["status"] != "ok":
            self._print(f"{self.prefix}: {row['status']} {row['message']}{timing}")
            return
        mib = row["peak_mem_bytes"] / 2**20
        match = "  DOES NOT MATCH BASELINE" if row.get("matches_baseline") is False else ""
        steps = f" ({row['measured_steps']} steps, {row['timing_stop_reason']})" if row.get("timing_stop_reason") \
            else ""
        self._print(f"{self.prefix}: {row['step_time_ms_median']:.1f} ms/step{steps}, peak {mib:.1f} MiB{match}"
                    f"{timing}")


# What an interrupt (Ctrl-C) should tell the user: set by a command once it knows what it writes.
_interrupt_note = {"text": "interrupted: nothing was written"}


def _resume_command(path: Path) -> str:
    """The command line of this run with `--resume path` in place of any --resume it had."""
    argv, kept, skip = _ARGV["argv"], [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--resume":
            skip = True
            continue
        if arg.startswith("--resume="):
            continue
        kept.append(arg)
    python = Path(sys.executable)
    try:
        python = python.relative_to(Path.cwd())
    except ValueError:
        pass
    return shlex.join([str(python), "-m", "bench", *kept, "--resume", str(path)])


def _announce(cases, out_path: Path, resumed: bool) -> None:
    """Before the first case: how many cases, how many steps each, where the results go, and how to be quick."""
    if not cases:
        print(f"nothing left to run in {out_path}", file=sys.stderr, flush=True)
        return
    workloads = list(dict.fromkeys(c.workload for c in cases))
    per_case = "; ".join(dict.fromkeys(_timing_text(c) for c in cases))
    print(f"{'resuming' if resumed else 'running'} {len(cases)} case(s) of {', '.join(workloads)} on "
          f"{cases[0].device}, {per_case} (plus a verification and a memory pass), into "
          f"{out_path}", file=sys.stderr, flush=True)
    if cases[0].device == "cpu" and any((c.steps or c.min_steps) > 3 or c.warmup > 1 for c in cases):
        print("  a CPU step at a full batch can take seconds: --quick (1 warm-up + 3 measured steps) or a "
              "smaller --batch-size gives a first look in minutes; the time left is shown after each case",
              file=sys.stderr, flush=True)


def _timing_text(case) -> str:
    """How a case is timed, in words: a fixed count, or adaptive timing with its options."""
    if case.steps is not None:
        return f"{case.warmup} warm-up + {case.steps} measured steps each"
    return (f"{case.warmup} warm-up + at least {case.min_steps} measured step(s) each, until the median's 95% "
            f"interval is within {case.target_ci_rel:.0%} of it or after {case.max_time_s:g} s of timed steps")


def _sweep_estimate(cases):
    """A bench.run.eta.SweepEstimate of the cases, knowing which autocast to a 16-bit type this CPU emulates."""
    from bench.measure.env import emulated_on_cpu
    from bench.run.eta import SweepEstimate
    from bench.run.runner import autocast_dtype, bind_case

    emulated = {}
    for index, case in enumerate(cases):
        try:
            dtype = autocast_dtype(bind_case(case)[0])
        except Exception:  # noqa: BLE001 - a case that cannot bind fails as a row of its own; no estimate for it
            continue
        if emulated_on_cpu(dtype, case.device):
            emulated[index] = dtype
    return SweepEstimate(list(cases), emulated)


def _run_suite(suite, device: str, out: str, options=None, resume: str | None = None, args=None):
    """Runs the suite's cases into a new CSV under `out`, or, with `resume`, the unfinished ones into that CSV.

    Everything is checked before the first case: the output folder (or the resumed file) is writable, the step
    counts and thread count are sane, every case's strategy applies to its workload, and nobody else is writing
    the same file (bench.run.preflight.RunLock)."""
    from bench.core import progress
    from bench.core.results import new_run_id, to_frame
    from bench.run import preflight
    from bench.run.isolation import RunOptions
    from bench.run.runner import bind_case, run_cases

    options = options or RunOptions()
    preflight.check_threads(options.threads)
    executor = _executor(args, options, suite) if args is not None else None  # None: run_cases' own default
    cases = suite.cases(device)
    if args is not None:
        _check_steps(cases, args)
    preflight.check_cases(cases, bind_case)
    previous, run_id = None, None
    if args.resume:
        from bench.run.resume import load_resume

        if not Path(resume).is_file():
            raise UsageError(f"--resume {str(resume)!r}: no such results file")
        out_path = preflight.check_output_file(resume, "--resume")
    else:
        out_path = preflight.check_output_dir(out, "--out") / f"{new_run_id(device)}.csv"
    with preflight.RunLock(out_path):
        if resume:
            resumed = load_resume(resume, cases, options)  # read under the lock: another run may have just written it
            previous, run_id = resumed.rows, resumed.run_id
            print(f"resuming {out_path}: {len(previous)} finished, {len(resumed.remaining)} to run",
                  file=sys.stderr, flush=True)
            cases = resumed.remaining
        if device == "cpu":
            _check_memory(cases)
        _announce(cases, out_path, bool(resume))
        _interrupt_note["text"] = (
            f"interrupted: {out_path} holds every case that finished; to run the rest:\n  "
            f"{_resume_command(out_path)}" if resume else
            f"interrupted before the first case finished: nothing was written (the results would have gone to "
            f"{out_path})")
        from bench.measure.env import cpu_name

        bar = _Progress(estimate=_sweep_estimate(cases), cpu=cpu_name())

        def on_case(index, total, case, row):
            bar.case(index, total, case, row)
            if row is not None and not resume:
                _interrupt_note["text"] = (f"interrupted: {out_path} holds every case that finished; to run "
                                           f"the rest:\n  {_resume_command(out_path)}")

        with progress.listening(bar.step):
            rows = run_cases(cases, out_path, progress=on_case, options=options, previous_rows=previous,
                             run_id=run_id, **({"executor": executor} if executor else {}))
    return to_frame(rows), out_path


def _finish_run(frame, path: Path) -> int:
    """Prints the table and the file; exit status 1 when no case succeeded (every row oom, unsupported, error)."""
    print(format_table(frame))
    print(f"\nwrote {path}")
    if frame.empty or not (frame["status"] == "ok").any():
        counts = ", ".join(f"{n} {status}" for status, n in frame["status"].value_counts().items())
        print(f"error: no case succeeded ({counts or 'no rows'}); the message column of {path} says why",
              file=sys.stderr)
        return 1
    return 0


def format_table(frame) -> str:
    """The console table: per workload, one line per case, memory and time relative to that workload's baseline;
    pitfalls (and the baseline's eval, autograd left on) apart, with the memory each adds per step."""
    import pandas as pd

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
        lines.append(f"~ noisy: the 95% CI of the step time is wider than {_noise_threshold():.0%} of the median")
    if "emulated_16bit" in frame and (frame["emulated_16bit"].astype(str).str.lower() == "true").any():
        emulated = frame.loc[frame["emulated_16bit"].astype(str).str.lower() == "true", "strategy"]
        lines.append(f"{', '.join(dict.fromkeys(map(str, emulated)))}: 16-bit autocast that this CPU emulates in float32 "
                     "(no native instructions; `python -m bench env`): their times are this CPU's emulation, not "
                     "what 16-bit arithmetic costs")
    lines += _rank_lines(frame)
    if {"peak_mem_spread_bytes", "repeats"} <= set(frame.columns) and (pd_num(frame["repeats"]) > 1).any():
        spread = pd_num(frame["peak_mem_spread_bytes"]).where(frame["status"] == "ok")
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
    for _, r in frame[(pd_num(frame["ranks"]) > 1) & (frame["status"] == "ok")].iterrows():
        parts = [r.get(f"peak_{name}_bytes") for name in RANK_BREAKDOWN]
        lines.append(f"{r['strategy']:<32} {r['phase']:<5} {int(r['ranks']):>5} "
                     f"{r['rank_peak_max_bytes'] / 2**20:>9.1f} {r['rank_peak_min_bytes'] / 2**20:>9.1f}  "
                     + " ".join(f"{(v or 0) / 2**20:>11.1f}" for v in parts))
    return lines


def _table_line(r) -> tuple[str, bool]:
    """One case's line of the console table, and whether its step time is noisy."""
    def num(value, fmt):
        return fmt.format(value) if value == value and value is not None else "-"
    mib = r["peak_mem_bytes"] / 2**20 if r["status"] == "ok" else float("nan")
    match = {True: "yes", False: "NO"}.get(r["matches_baseline"], "-")
    status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['message']}"
    noisy = r.get("noisy") is True or str(r.get("noisy")).lower() == "true"
    noisy = noisy and r["status"] == "ok"
    step = num(r["step_time_ms_median"], "{:.1f}") + ("~" if noisy else "")
    return (f"{r['strategy']:<32} {r['phase']:<5} {r['batch_size']:>5} {num(mib, '{:.1f}'):>9} "
            f"{num(r['mem_vs_baseline'], RELATIVE_FORMAT):>7} {step:>9} "
            f"{num(r['step_time_ms_iqr'], '{:.1f}'):>7} {_ci(r):>15} "
            f"{num(r['time_vs_baseline'], RELATIVE_FORMAT):>7} {match:>7}  {status}"), noisy


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and value == value


def pd_num(column):
    import pandas as pd

    return pd.to_numeric(column, errors="coerce").fillna(0)


def _ci(r) -> str:
    low, high = r.get("step_time_ms_ci95_low"), r.get("step_time_ms_ci95_high")
    if low is None or high is None or low != low or high != high or r["status"] != "ok":
        return "-"
    return f"[{low:.1f}, {high:.1f}]"


def _noise_threshold() -> float:
    from bench.measure.stats import NOISE_THRESHOLD

    return NOISE_THRESHOLD


# --- subcommands -----------------------------------------------------------------------------------------

def cmd_list(args) -> int:
    """Workloads, strategies and pitfalls with one-line descriptions."""
    from strategies import STRATEGIES
    from workloads import WORKLOADS, workload_names

    print("workloads (options with name:option=value; your own model: path/to/file.py:NAME):")
    for name in workload_names():
        cls = WORKLOADS.get(name)
        details = [f"data: {', '.join(cls.data_sources)}", f"batch {cls.default_batch_size}"]
        if cls.options:
            details.append("options: " + ", ".join(f"{k}={v}" for k, v in cls.options.items()))
        print(f"  {name:<20} {cls.description} [{'; '.join(details)}]")
    techniques = [name for name in STRATEGIES if not STRATEGIES.get(name).pitfall]
    pitfalls = [name for name in STRATEGIES if STRATEGIES.get(name).pitfall]
    print("strategies (combine with +, options with name:option=value):")
    _list_strategies(techniques)
    print("pitfalls (habits the articles warn about, run to show what they cost; the baseline's eval, autograd on "
          "during validation, is one too):")
    _list_strategies(pitfalls)
    return 0


def _list_strategies(names: list[str]) -> None:
    from strategies import STRATEGIES

    for name in names:
        cls = STRATEGIES.get(name)
        options = ", ".join(f"{k}={v}" for k, v in cls.options.items())
        print(f"  {name:<22} {cls.description}" + (f" [options: {options}]" if options else ""))


def cmd_env(args) -> int:
    """The environment as every results row records it."""
    from bench.measure.env import environment, resolve_device

    device = resolve_device(args.device)
    print(f"{'device':<16} {device}")
    for key, value in environment(device).items():
        print(f"{key:<16} {value}")
    for line in cpu_16bit_lines():
        print(line)
    return 0


def cpu_16bit_lines(flags=None) -> list[str]:
    """What `env` says of the CPU's 16-bit arithmetic: native (and the flags that say so) or emulated, per type."""
    from bench.measure.env import NATIVE_16BIT_FLAGS, cpu_16bit_support, cpu_flags
    from bench.run.eta import EMULATED_SLOWDOWN

    flags = cpu_flags() if flags is None else frozenset(flags)
    lines = []
    for dtype, native in cpu_16bit_support(flags).items():
        seen = [flag for flag in NATIVE_16BIT_FLAGS[dtype] if flags and flag in flags]
        text = (f"native ({', '.join(seen)})" if native and seen else "native" if native else
                f"EMULATED in float32 (no {'/'.join(NATIVE_16BIT_FLAGS[dtype])}): autocast to {dtype} runs far "
                f"slower than float32 here ({EMULATED_SLOWDOWN[0]:g}-{EMULATED_SLOWDOWN[1]:g}x for bfloat16 on the "
                "reference AMD EPYC)")
        lines.append(f"{'cpu ' + dtype:<16} {text}")
    return lines


def cmd_run(args) -> int:
    """Runs a suite file, or the strategies given with --strategies."""
    from bench.measure.env import resolve_device

    if not args.suite and not args.strategies:
        raise UsageError("run needs --suite FILE or --strategies a,b (see `python -m bench list`)")
    device = resolve_device(args.device)
    fraction = apply_memory_limit(getattr(args, "memory_limit", None), device)
    strategies = _csv_list(args.strategies) if args.strategies else None
    suite = _suite_from_args(args, device, strategies)
    options = _run_options(args, device, suite, fraction)
    frame, path = _run_suite(suite, device, args.out, options, args.resume, args)
    return _finish_run(frame, path)


def cmd_compare(args) -> int:
    """Baseline plus the named strategies: a console table relative to baseline, and the CSV."""
    from bench.measure.env import resolve_device

    device = resolve_device(args.device)
    fraction = apply_memory_limit(getattr(args, "memory_limit", None), device)
    suite = _suite_from_args(args, device, _csv_list(args.strategies))
    options = _run_options(args, device, suite, fraction)
    frame, path = _run_suite(suite, device, args.out, options, args.resume, args)
    return _finish_run(frame, path)


def cmd_report(args) -> int:
    """Draws the charts and REPORT.md from results CSVs alone (default: the newest CSV in runs/)."""
    from bench.core.results import REPORT_COLUMNS, read_results_file
    from bench.report.markdown import build_report, newest_csv, parse_size
    from bench.run.preflight import check_output_dir

    try:
        budget = parse_size(args.budget) if args.budget else None
    except ValueError as error:
        raise UsageError(f"bad --budget {args.budget!r}: {error}") from None
    if args.csv:
        paths = [Path(p) for p in args.csv]
    else:
        try:
            paths = [newest_csv(Path(args.results))]
        except FileNotFoundError:
            raise UsageError(f"no results CSV in {args.results!r}; run `python -m bench compare` first, or name "
                             "a CSV (the reference runs are under results/reference/)") from None
    for path in paths:
        read_results_file(path, "cannot report on", REPORT_COLUMNS)  # every file checked before anything is drawn
    out = check_output_dir(args.out or paths[0].parent, "--out" if args.out else "the results file's folder")
    report = build_report(paths, out, budget)
    print(f"wrote {report}")
    return 0


# --- memory analysis: explain, predict, fit, --memory-limit ------------------------------------------------

def _one_batch_size(text, option: str = "--batch-size") -> int:
    sizes = _batch_sizes(text, option)
    if len(sizes) != 1:
        raise UsageError(f"{option}: bad batch size {text!r}; this command takes one batch size")
    return sizes[0]


def _check_choice(kind: str, value: str, choices, option: str | None = None) -> str:
    """`value` if it is one of `choices`; else a UsageError naming the option (default `--<kind>`)."""
    if value not in choices:
        raise UsageError(f"{option or '--' + kind}: {choices_error(kind, value, choices)}")
    return value


def _analysis_device(text: str) -> str:
    return _check_choice("device", text, ("cpu", "cuda"))


def _size_option(text: str, option: str) -> int:
    """A positive size (`4GiB`, `1e9`) given to `option`; a UsageError naming the option otherwise."""
    from bench.analysis.explain import parse_bytes

    try:
        return parse_bytes(text)
    except UsageError as error:
        raise UsageError(f"{option}: {error}") from None


def _status(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _workload_and_data(args) -> tuple[str, str]:
    """The workload's canonical spec and the data source (default: synthetic where the workload has it, since
    memory does not depend on the values, else its first)."""
    from workloads import get_workload

    workload = get_workload(args.workload or DEFAULT_WORKLOAD)
    default = "synthetic" if "synthetic" in workload.data_sources else workload.data_sources[0]
    return workload.spec(), workload.check_data(args.data or default)


def _add_memory_limit_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-limit", default=None,
                   help="cap CUDA memory: bytes (2GiB, 512MiB, 1e9) or a fraction of the GPU (0.5); "
                        "on the CPU a warning and no effect (default: no cap)")


def apply_memory_limit(limit: str | None, device: str) -> float | None:
    """`--memory-limit`: torch.cuda.set_per_process_memory_fraction; on the CPU a warning line, nothing else.

    Returns the fraction set (None when nothing was set)."""
    if limit is None:
        return None

    from bench.core.units import fraction_or_size

    fraction = fraction_or_size(limit)
    nbytes = _size_option(limit, "--memory-limit") if fraction is None else None
    if device != "cuda":
        print(f"warning: --memory-limit {limit} has no effect on device {device} (it caps CUDA memory only)",
              file=sys.stderr)
        return None
    import torch

    if fraction is None:
        total = torch.cuda.get_device_properties(0).total_memory
        fraction = min(1.0, nbytes / total)
    torch.cuda.set_per_process_memory_fraction(fraction)
    return fraction


def cmd_explain(args) -> int:
    """The peak of one case broken down (params, grads, optimizer, activations, temporaries, batch), the rule
    of thumb beside it, and memory added by each module's forward."""
    from bench.analysis import explain as analysis
    from bench.core.errors import Unsupported
    from dataclasses import replace

    from bench.run.rule_of_thumb import rule_of_thumb
    from bench.run.runner import Case, CaseMeter, bind_case

    workload, data = _workload_and_data(args)
    phase = _check_choice("phase", args.phase, ("train", "eval"))
    device = _check_choice("device", args.device, ("cpu",))  # the breakdown needs the exact CPU tracker
    batch = _one_batch_size(args.batch_size)
    strategy, context = bind_case(Case(workload, args.strategy, phase, batch, device, data=data))
    try:
        strategy.check(context)
    except Unsupported as error:
        raise UsageError(f"{strategy.spec()} cannot run here: {error}") from None
    case = Case(workload, strategy.spec(), phase, batch, device, data=data)
    try:
        strategy.plan(CaseMeter(case))
    except Unsupported as error:
        raise UsageError(f"{strategy.spec()} cannot run here: {error}") from None
    result = analysis.explain(case, strategy)
    print(analysis.format_explain(case, result["memory"], result["modules"],
                                  rule_of_thumb(workload, phase, batch)))
    plan = analysis.checkpoint_plan_of(strategy)
    if plan is not None and phase == "train":
        baseline = analysis.measured_peak(replace(case, strategy="baseline"),
                                          bind_case(replace(case, strategy="baseline"))[0])
        print(analysis.format_plan_units(*plan, analysis.plan_units(case), result["memory"]["peak_mem_bytes"],
                                         baseline))
    return 0


def _capability(text: str | None) -> tuple[int, int] | None:
    """`--capability 9.0` as (9, 0); None when not given; a UsageError for anything but MAJOR.MINOR."""
    if text is None:
        return None
    major, dot, minor = text.partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        raise UsageError(f"--capability: bad compute capability {text!r}; give MAJOR.MINOR, e.g. 8.6 or 9.0")
    return int(major), int(minor)


def cmd_predict(args) -> int:
    """Predicted torch.cuda.max_memory_allocated per case, without a GPU (assumptions printed); writes a CSV."""
    import pandas as pd

    from bench.analysis import predict
    from bench.core.results import new_run_id, write_csv_atomic
    from bench.run.runner import Case
    from strategies import parse_strategy

    from bench.run.preflight import check_output_dir

    workload, data = _workload_and_data(args)
    device = _analysis_device(args.device)
    engine = _check_choice("engine", args.engine, predict.ENGINES)
    capability = _capability(args.capability)
    phases = [_check_choice("phase", p, ("train", "eval")) for p in _csv_list(args.phases)]
    specs = ["baseline"] + [s for s in _csv_list(args.strategies or "") if s != "baseline"]
    for spec in specs:
        parse_strategy(spec)  # unknown names: exit 2 before any work
    batches = _batch_sizes(args.batch_size)
    out = check_output_dir(args.out, "--out")
    _interrupt_note["text"] = "interrupted: nothing was written (predict writes its table at the end)"
    cases = [Case(workload, spec, phase, batch, device, data=data) for spec in specs for phase in phases
             for batch in batches]

    def progress(index: int, case: Case) -> None:
        _status(predict.progress_line(index, len(cases), case))

    rows = predict.predict_cases(cases, engine, args.ranks, capability, on_case=progress)
    print(f"predicted peak memory on {device}" + (" (torch.cuda.max_memory_allocated and max_memory_reserved)"
                                                  if device == "cuda" else " (exact live tensor bytes)"))
    print(predict.format_predictions(rows))
    if device == "cuda":
        print("\nassumptions:")
        for line in predict.assumptions(row["engine"] for row in rows):
            print(f"  - {line}")
    path = out / f"predict-{new_run_id(device)}.csv"
    write_csv_atomic(pd.DataFrame(rows), path)
    print(f"\nwrote {path}")
    return 0


def cmd_fit(args) -> int:
    """The largest batch size under a memory budget, per strategy (baseline always), each verified by a run."""
    import pandas as pd

    from bench.analysis import explain as analysis
    from bench.core.results import new_run_id, write_csv_atomic
    from bench.core.units import format_size
    from bench.run import preflight
    from bench.run.preflight import check_output_dir
    from strategies import parse_strategy

    budget = _size_option(args.budget, "--budget")
    workload, data = _workload_and_data(args)
    device = _analysis_device(args.device)
    if device == "cuda":
        from bench.measure.env import resolve_device
        resolve_device("cuda")
    phase = _check_choice("phase", args.phase, ("train", "eval"))
    max_batch = _one_batch_size(args.max_batch, "--max-batch")
    specs = _csv_list(args.strategies or "")
    for spec in specs:
        parse_strategy(spec)
    preflight.check_steps(args.time_steps, "--time-steps", 0)
    memory = preflight.machine_memory_bytes()
    if device == "cpu" and memory is not None and budget > memory:
        # fit confirms each answer with a real run: a budget beyond the machine's memory cannot be confirmed
        raise UsageError(f"--budget {args.budget} is more than this machine's {format_size(memory)} of memory; "
                         "on the CPU each answer is confirmed by a real run, so give a budget below that (or "
                         "`predict` for larger batches)")
    out = check_output_dir(args.out, "--out")
    apply_memory_limit(args.memory_limit, device)
    _interrupt_note["text"] = "interrupted: nothing was written (fit writes its table when every strategy is done)"
    results = analysis.fit(specs, budget, phase, device, workload, data, max_batch, args.time_steps,
                           progress=_status)
    print(f"largest batch with peak <= {args.budget} ({budget:,} B) on {device}, phase {phase}")
    print(analysis.format_fit(results, args.time_steps))
    path = out / f"fit-{new_run_id(device)}.csv"
    write_csv_atomic(pd.DataFrame(analysis.fit_rows(results)), path)
    print(f"\nwrote {path}")
    return 0


def _add_table_options(p: argparse.ArgumentParser) -> None:
    """Options of the commands that write a table of their own (predict, fit)."""
    p.add_argument("--data", default=None, help="a data source of the workload (default synthetic where it has one)")
    p.add_argument("--workload", default=None, help=WORKLOAD_HELP)
    p.add_argument("--out", default=DEFAULT_OUT, help=f"folder for the CSV (default {DEFAULT_OUT}/)")


# What each command does, as `--help` shows it to a user.
COMMAND_HELP = {
    "list": "list the workloads and strategies, with their options",
    "env": "show the environment every results row records (device, torch, CPU threads, commit)",
    "run": "run a suite file, or the strategies given with --strategies, into a results CSV",
    "compare": "run the baseline and each named strategy, print a table relative to the baseline, write the CSV",
    "report": "draw the charts and REPORT.md from results CSVs alone (no torch needed)",
    "explain": "break one case's peak memory down (weights, gradients, optimizer, activations, ...) module by module",
    "predict": "estimate the peak memory of each strategy (CUDA's by default) without running on that device",
    "fit": "find the largest batch size whose peak stays under a memory budget, per strategy, confirmed by a run",
}


def _add_command(sub, name: str, func):
    p = sub.add_parser(name, help=COMMAND_HELP[name], description=COMMAND_HELP[name][0].upper() + COMMAND_HELP[name][1:] + ".")
    p.set_defaults(func=func)
    return p


def _add_analysis_parsers(sub) -> None:
    p = _add_command(sub, "explain", cmd_explain)
    p.add_argument("--strategy", required=True, help="one strategy spec, e.g. baseline or checkpoint+amp")
    p.add_argument("--phase", default="train", help="train or eval (default train)")
    p.add_argument("--batch-size", default="100", help="one batch size (default 100)")
    p.add_argument("--device", default="cpu", help="cpu, the only choice: the breakdown needs the exact CPU count "
                                                   "(default cpu)")
    p.add_argument("--data", default=None, help="a data source of the workload (default synthetic where it has one: "
                                                 "memory does not depend on the values)")
    p.add_argument("--workload", default=None, help=WORKLOAD_HELP)

    p = _add_command(sub, "predict", cmd_predict)
    p.add_argument("--strategies", default="", help="comma list (baseline is always included; default: baseline only)")
    p.add_argument("--device", default="cuda", help="cuda (predict CUDA on any machine) or cpu (default cuda)")
    p.add_argument("--batch-size", default="100", help="one size or a comma list (default 100)")
    p.add_argument("--phases", default="train,eval", help="train,eval, train or eval (default train,eval)")
    p.add_argument("--ranks", type=_positive_int, default=1,
                   help="for the sharded strategies (ddp, zero1, fsdp): the peak of the largest of N ranks, without "
                        "starting N processes (PyTorch's fake process group; default 1)")
    p.add_argument("--engine", default="auto",
                   help="auto (fake tensors: for CUDA on CUDA's own operators where the fake-CUDA environment exists, "
                        "`make cuda-fake-env`, else on the CPU's; a real CPU step where they cannot run a strategy), "
                        "fake-cuda, fake, meta or cpu (default auto)")
    p.add_argument("--capability", default=None,
                   help="compute capability of the CUDA device predicted, e.g. 9.0 (sizes cuBLAS's workspace; "
                        "default: this machine's GPU, else a non-Hopper one)")
    _add_table_options(p)

    p = _add_command(sub, "fit", cmd_fit)
    p.add_argument("--budget", required=True, help="memory budget: 4GiB, 512MiB, 1e9 ... (required)")
    p.add_argument("--strategies", default="", help="comma list (baseline is always included; default: baseline only)")
    p.add_argument("--device", default="cpu", help="cpu (exact count) or cuda (real attempts) (default cpu)")
    p.add_argument("--phase", default="train", help="train or eval (default train)")
    p.add_argument("--max-batch", default="4096", help="largest batch size tried (default 4096)")
    p.add_argument("--time-steps", type=_non_negative_int, default=1,
                   help="timed steps at the largest batch (0: no timing; default 1)")
    _add_table_options(p)
    _add_memory_limit_option(p)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m bench", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="{" + ",".join(COMMAND_HELP) + "}")
    sub.required = True

    _add_command(sub, "list", cmd_list)

    p = _add_command(sub, "env", cmd_env)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")

    p = _add_command(sub, "run", cmd_run)
    p.add_argument("--suite", default=None, help="a suite YAML file, e.g. bench/suites/default.yaml (what `make "
                                                 "bench` runs); default: none, give --strategies")
    p.add_argument("--strategies", default=None, help="comma list of strategies, e.g. checkpoint,amp,checkpoint+amp "
                                                      "(default: the suite's)")
    _add_case_options(p)
    _add_memory_limit_option(p)

    p = _add_command(sub, "compare", cmd_compare)
    p.add_argument("--strategies", required=True, help="comma list, e.g. checkpoint,amp (baseline is always run)")
    _add_case_options(p)
    _add_memory_limit_option(p)

    p = _add_command(sub, "report", cmd_report)
    p.add_argument("csv", nargs="*", help="results CSV files (default: the newest in --results)")
    p.add_argument("--results", default=DEFAULT_OUT, help=f"where to look for the newest CSV (default {DEFAULT_OUT}/)")
    p.add_argument("--out", default=None, help="where to write the charts and REPORT.md (default: the CSV's folder)")
    p.add_argument("--budget", default=None, help="a memory budget line for the batch-size chart, e.g. 4GiB "
                                                  "(default: none)")
    _add_analysis_parsers(sub)
    return parser


# The command line of this invocation, for the `--resume` command an interrupt prints.
_ARGV = {"argv": []}


def main(argv: Sequence[str] | None = None) -> int:
    _ARGV["argv"] = list(sys.argv[1:] if argv is None else argv)
    _interrupt_note["text"] = "interrupted: nothing was written"
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{_interrupt_note['text']}", file=sys.stderr)
        return 130
