"""What `run`, `compare`, `list` and `env` do: run cases (one path for run and compare) or describe them. Their
names, help lines and options are in bench/cli/commands/, whose run functions import this module when they run."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

from bench.cli import interrupt, preflight_steps
from bench.cli.arguments import (DEFAULT_ISOLATED_CASE_TIMEOUT_S, EXECUTORS, csv_list, size_option, step_batch_text,
                                 step_batches)
from bench.cli.console import Progress, announce, finish_run
from bench.core import progress
from bench.core.atomic import WriteFailed
from bench.core.errors import UsageError
from bench.core.results import new_run_id, to_frame
from bench.core.snapshots import writable_snapshot_folder
from bench.core.units import fraction_or_size
from bench.measure import cpu_16bit, env
from bench.run import preflight
from bench.run.eta import EMULATED_SLOWDOWN, sweep_estimate
from bench.run.isolation import RunOptions
from bench.run.ray_executor import RayExecutor, check_address, import_ray, probe_address
from bench.run.resume import load_resume
from bench.run.case import bind_case
from bench.run.runner import local_executor, run_cases
from bench.run.suite import Suite, SuiteOverrides, suite_for_command_line
from strategies import STRATEGIES
from strategies.framework import catalog
from workloads import WORKLOADS, workload_names

# The most the pre-flight's memory estimate of one workload may take under --case-timeout (it only decides whether
# to warn; a model slower than this on the meta device is run unchecked)
PREFLIGHT_LIMIT_S = 30.0
# The most the header's calibration of the first case (two real steps at small batches, a second or so) may take:
# it only informs, and a model that never returns must not hang the run before its first case
CALIBRATION_LIMIT_S = 10.0


def cmd_run(args) -> int:
    """Runs a suite file, or the strategies given with --strategies."""
    if not args.suite and not args.strategies:
        raise UsageError("run needs --suite FILE or --strategies a,b (see `python -m bench list`)")
    return _run_and_print(args, csv_list(args.strategies) if args.strategies else None)


def cmd_compare(args) -> int:
    """Baseline plus the named strategies: a console table relative to baseline, and the CSV."""
    return _run_and_print(args, csv_list(args.strategies))


def _run_and_print(args, strategies: list[str] | None) -> int:
    """`run` and `compare`: the suite with the command line's values over it, run into a CSV, then the table."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError(preflight.no_cuda_message(torch.__version__, torch.version.cuda, interrupt.python()))
    device = env.resolve_device(args.device)
    fraction = apply_memory_limit(getattr(args, "memory_limit", None), device)
    overrides = _suite_overrides(args, strategies)
    if overrides.workloads and _isolated(args, device):  # before this process imports the user's code
        preflight_steps.workloads_resolve_in_child(preflight_steps.user_workload_specs(overrides.workloads))
    suite = suite_for_command_line(getattr(args, "suite", None), device, overrides)
    options = _run_options(args, device, suite, fraction)
    try:
        frame, path = _run_suite(args, suite, device, options, overrides)
    except WriteFailed as error:
        print(f"error: {write_failed_line(error)}", file=sys.stderr)
        return 1
    return finish_run(frame, path)


def write_failed_line(error: WriteFailed) -> str:
    """What a run says when writing its results failed (a full disk, a file-size limit): the write is atomic, so
    the results file is the last one written whole (or absent), and the `--resume` command that finishes the run."""
    results = Path(_state["out_path"] or error.path)
    done = f"could not write {error.path} ({error.strerror})"
    if not results.is_file():
        return f"{done}: nothing was written; make room and run again"
    return (f"{done}; {results} is still a valid results file, with every case written before (each write replaces "
            f"it whole or not at all); make room, then run the rest: {interrupt.resume_command(results)}")


# the results file of the run under way, for write_failed_line
_state: dict = {"out_path": None}


def _suite_overrides(args, strategies: list[str] | None) -> SuiteOverrides:
    """What the command line sets over the suite (an empty option leaves the suite's value)."""
    return SuiteOverrides(
        strategies=strategies, workloads=csv_list(args.workload) if args.workload else None,
        data=args.data or None, phases=csv_list(args.phases) if args.phases else None,
        batch_sizes=step_batch_text(args) or None, steps=args.steps, warmup=args.warmup, min_steps=args.min_steps,
        max_time_per_case=args.max_time_per_case, target_ci=args.target_ci, quick=args.quick)


def _isolated(args, device: str) -> bool:
    """Whether the command line asks for isolated cases (the suite file's executor is not read yet)."""
    return args.isolate if args.isolate is not None else device == "cuda" or args.executor == "ray"


def _run_options(args, device: str, suite: Suite, memory_fraction: float | None) -> RunOptions:
    """The run's options; `--executor` and `--ray-address` fall back to the suite file's `executor`/`ray_address`.
    `memory_fraction`: the cap `--memory-limit` set here (`apply_memory_limit`), for the worker processes."""
    executor = preflight.check_choice("executor", args.executor or suite.executor or "local", EXECUTORS)
    isolate = args.isolate if args.isolate is not None else device == "cuda"
    timeout = _case_timeout(args, executor, isolate or executor == "ray")
    return RunOptions(isolate=isolate or executor == "ray" or timeout is not None, repeats=args.repeats,
                      threads=args.threads, deterministic=args.deterministic, executor=executor, ranks=args.ranks,
                      memory_fraction=memory_fraction, case_timeout_s=timeout)


def _case_timeout(args, executor: str, isolated: bool) -> float | None:
    """The per-case limit in seconds, or None: `--case-timeout` (0 for none), else a generous default where the
    local executor runs cases isolated; refused where it cannot be enforced (in this process, on Ray)."""
    limit = getattr(args, "case_timeout", None)
    if limit is None:
        return DEFAULT_ISOLATED_CASE_TIMEOUT_S if isolated and executor == "local" else None
    if limit == 0:
        return None
    if args.isolate is False:
        raise UsageError(f"--case-timeout {limit:g} needs each case in a worker process that can be killed (a "
                         "forward stuck in Python cannot be stopped in this one): drop --no-isolate")
    if executor == "ray":
        raise UsageError(f"--case-timeout {limit:g} is not enforced on --executor ray: drop one of them")
    return limit


def _executor(args, options: RunOptions, suite: Suite):
    """The runner's executor for `options.executor` (bench.run.runner.local_executor, or a RayExecutor)."""
    if options.executor != "ray":
        if args.ray_address:
            raise UsageError("--ray-address needs --executor ray")
        return local_executor
    address = args.ray_address or suite.ray_address
    option = "--ray-address" if args.ray_address else "the suite's ray_address"
    checked = address or os.environ.get("RAY_ADDRESS", "").strip()  # ray.init() reads $RAY_ADDRESS without one
    option = option if address else "$RAY_ADDRESS"
    if checked:
        check_address(checked, option)  # its form first: a typo is named before Ray is even imported
    import_ray()  # a missing package is an error before any case
    if checked:
        probe_address(checked, option)  # seconds, not Ray's retries, to learn that nothing answers there
    return RayExecutor(address)


def _output_path(args, device: str) -> Path:
    """The results file: the one `--resume` names, or a new one under `--out`; checked writable."""
    if args.resume:
        path = Path(args.resume)
        if not path.is_file():
            raise UsageError(f"--resume {str(args.resume)!r}: no such results file")
        if path.is_symlink():  # the atomic rename would replace the link with a regular file: write through it
            path = path.resolve()
            print(f"--resume {args.resume} is a symbolic link: writing to its target {path} (the link stays)",
                  file=sys.stderr)
        return preflight.check_output_file(path, "--resume")
    return preflight.check_output_dir(args.out, "--out") / f"{new_run_id(device)}.csv"


def _run_suite(args, suite: Suite, device: str, options: RunOptions, overrides: SuiteOverrides):
    """Runs the suite's cases into a new CSV under `--out`, or, with `--resume`, the unfinished ones into that CSV.

    Everything is checked before the first case: the output folder (or the resumed file) is writable, the step
    counts and thread count are sane, every case's strategy applies to its workload, the largest batch fits in
    memory, and nobody else is writing the same file (bench.run.preflight.RunLock)."""
    preflight.check_threads(options.threads)
    preflight.check_ranks(options.ranks, device)
    preflight.check_repeats(options.repeats)
    executor = _executor(args, options, suite)
    cases = [replace(case, batch_size=size) for case in suite.cases(device)
             for size in step_batches(args, [case.batch_size], options.ranks)]
    overrides.check_steps(cases)
    preflight.check_cases(cases, bind_case)
    preflight.check_ranks_shard(options.ranks, dict.fromkeys(case.strategy for case in cases))
    previous, run_id = None, None
    out_path = _output_path(args, device)
    _state["out_path"] = out_path
    if getattr(args, "snapshot", False):  # each case's memory snapshot goes to <run>.snapshots/
        options = replace(options, snapshot_dir=str(writable_snapshot_folder(out_path)))
    with preflight.RunLock(out_path):
        if args.resume:
            resumed = load_resume(out_path, cases, options)  # read under the lock: another run may have written it
            previous, run_id = resumed.rows, resumed.run_id
            print(f"resuming {out_path}: {len(previous)} finished, {len(resumed.remaining)} to run",
                  file=sys.stderr, flush=True)
            cases = resumed.remaining
        limit = options.case_timeout_s and min(options.case_timeout_s, PREFLIGHT_LIMIT_S)
        calibration_limit = min(options.case_timeout_s or CALIBRATION_LIMIT_S, CALIBRATION_LIMIT_S)
        # these run the user's model: under --isolate in a child, so that its os._exit cannot end this process
        steps = preflight_steps.user_code_steps_in_child if options.isolate else preflight_steps.user_code_steps
        note = steps(cases, device == "cpu", limit, calibration_limit) if cases else None
        announce(cases, out_path, bool(args.resume), quick_overridden_by(args), note)
        interrupt.set_note(interrupt.resume_note(out_path) if args.resume else
                           f"interrupted before the first case finished: nothing was written (the results would "
                           f"have gone to {out_path})")
        bar = Progress(estimate=sweep_estimate(cases), cpu=env.cpu_name())

        def on_case(index, total, case, row):
            bar.case(index, total, case, row)
            if row is not None and not args.resume:
                interrupt.set_note(interrupt.resume_note(out_path))

        with progress.listening(bar.step):
            rows = run_cases(cases, out_path, progress=on_case, options=options, previous_rows=previous,
                             run_id=run_id, executor=executor)
    return to_frame(rows), out_path


def quick_overridden_by(args) -> tuple[str, ...]:
    """The adaptive-timing options given beside --quick: they win over its 3 fixed steps (bench.run.suite)."""
    if not getattr(args, "quick", False):
        return ()
    given = (("--min-steps", args.min_steps), ("--max-time-per-case", args.max_time_per_case),
             ("--target-ci", args.target_ci))
    return tuple(option for option, value in given if value is not None)


def apply_memory_limit(limit: str | None, device: str) -> float | None:
    """`--memory-limit`: torch.cuda.set_per_process_memory_fraction; on the CPU a warning line, nothing else.

    Returns the fraction set (None when nothing was set)."""
    if limit is None:
        return None
    fraction = fraction_or_size(limit)
    nbytes = size_option(limit, "--memory-limit") if fraction is None else None
    if device != "cuda":
        print(f"warning: --memory-limit {limit} has no effect on device {device} (it caps CUDA memory only)",
              file=sys.stderr)
        return None
    if fraction is None:
        total = torch.cuda.get_device_properties(0).total_memory
        fraction = min(1.0, nbytes / total)
    torch.cuda.set_per_process_memory_fraction(fraction)
    return fraction


def cmd_list(args) -> int:
    """Workloads, strategies and pitfalls with one-line descriptions."""
    print("workloads (options with name:option=value; your own model: path/to/file.py:NAME):")
    for name in workload_names():
        cls = WORKLOADS.get(name)
        details = [f"data: {', '.join(cls.data_sources)}", f"batch {cls.default_batch_size}"]
        if cls.options:
            details.append("options: " + ", ".join(f"{k}={v}" for k, v in cls.options.items()))
        print(f"  {name:<20} {cls.description} [{'; '.join(details)}]")
    techniques = [name for name in catalog.ordered_names() if not STRATEGIES.get(name).pitfall]
    pitfalls = [name for name in catalog.ordered_names() if STRATEGIES.get(name).pitfall]
    print("strategies (combine with +, options with name:option=value):")
    _list_strategies(techniques)
    print("pitfalls (habits the articles warn about, run to show what they cost; the baseline's eval, autograd on "
          "during validation, is one too):")
    _list_strategies(pitfalls)
    return 0


def _list_strategies(names: list[str]) -> None:
    for name in names:
        cls = STRATEGIES.get(name)
        options = ", ".join(f"{k}={v}" for k, v in cls.options.items())
        details = [catalog.runs_in(cls), *([f"options: {options}"] if options else [])]
        print(f"  {name:<22} {cls.description} [{'; '.join(details)}]")


def cmd_env(args) -> int:
    """The environment as every results row records it."""
    device = env.resolve_device(args.device)
    environment = {"device": device, **env.environment(device)}
    width = max(map(len, environment))
    for key, value in environment.items():
        print(f"{key:<{width}} {value}")
    for line in cpu_16bit_lines():
        print(line)
    return 0


def cpu_16bit_lines(flags=None) -> list[str]:
    """What `env` says of the CPU's 16-bit arithmetic: native (and the flags that say so) or emulated, per type."""
    lines = []
    for reason in cpu_16bit.support_reasons(flags):  # the CPU's own answer (no cap: flags are given)
        dtype, native, seen, cap, setting = reason.dtype, reason.native, reason.flags_seen, reason.cap, reason.setting
        variable, needed = cpu_16bit.CPU_16BIT_VARIABLE, "/".join(cpu_16bit.NATIVE_16BIT_FLAGS[dtype])
        if cap:
            lines.append(f"{'cpu ' + dtype:<16} EMULATED in float32: oneDNN capped at {cap[1]} by {cap[0]} (the CPU "
                         f"itself: native, {', '.join(seen) or 'as torch probes it'})")
            continue
        text = (f"native ({', '.join(seen)})" if native and seen else "native" if native else
                f"EMULATED in float32 (no {needed}): autocast to {dtype} runs far "
                f"slower than float32 here ({EMULATED_SLOWDOWN[0]:g}-{EMULATED_SLOWDOWN[1]:g}x for bfloat16 on the "
                "reference AMD EPYC)")
        if setting != "auto":  # MEMBENCH_CPU_16BIT overrides what the CPU says
            text = (f"{'native' if setting == 'native' else 'EMULATED'}: forced by {variable}={setting} "
                    f"(the CPU itself: {text.split(':')[0]})")
        lines.append(f"{'cpu ' + dtype:<16} {text}")
    return lines
