"""`python -m bench {list,env,run,compare,report,explain,predict,fit}`: one `cmd_<name>` function per subcommand."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from bench.errors import UsageError, choices_error

RELATIVE_FORMAT = "{:.2f}x"
DEFAULT_WORKLOAD = "captcha_resnet18"
WORKLOAD_HELP = ("a registered workload with options (see `list`; e.g. deep_mlp:layers=100, timm:resnet18) or your own: "
                 "path/to/file.py:NAME or package.module:NAME; default captcha_resnet18")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2 (no usage dump)."""

    def error(self, message: str):
        raise UsageError(message)


# --- argument helpers ----------------------------------------------------------------------------------

def _batch_sizes(text: str) -> list[int]:
    """`100` or `25,50,100` -> positive integers; anything else is a UsageError naming the bad part."""
    sizes = []
    for part in str(text).split(","):
        try:
            sizes.append(_positive_int(part))
        except UsageError:
            raise UsageError(f"bad batch size {part.strip()!r}; a batch size must be a positive integer "
                             "(e.g. 100 or 25,50,100)") from None
    return sizes


def _csv_list(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _add_case_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default=None, help=WORKLOAD_HELP)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    p.add_argument("--batch-size", default=None, help="one size or a comma list, e.g. 25,50,100 (default 100)")
    p.add_argument("--phases", default=None, help="train,eval (default both)")
    p.add_argument("--steps", type=int, default=None, help="measured steps per case")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps before timing")
    p.add_argument("--data", default=None, help="a data source of the workload (see `list`), e.g. captcha (real "
                                                 "images) or synthetic (random tensors); default the workload's first")
    p.add_argument("--out", default="results", help="folder for the results CSV (default results/)")
    p.add_argument("--quick", action="store_true", help="1 warm-up step and 3 measured steps")
    _add_sweep_options(p)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"bad value {text!r}; expected a positive integer") from None
    if value <= 0:
        raise UsageError(f"bad value {value}; expected a positive integer")
    return value


def _add_sweep_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="run each case (and each repeat) in a fresh Python process (default: on for cuda, "
                        "off for cpu); --no-isolate runs in this process with process-wide flags restored")
    p.add_argument("--repeats", type=_positive_int, default=1,
                   help="repeat each case's timing and memory passes K times; adds a 95%% CI and a noisy flag")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch.set_num_threads for every case (default: torch's default here, "
                        "usually the physical cores); recorded in cpu_threads")
    p.add_argument("--deterministic", action="store_true",
                   help="cudnn.deterministic and torch.use_deterministic_algorithms(True) for each case")
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
                   help="continue the run in this results CSV: skip its finished cases, run the rest into it")


EXECUTORS = ("local", "ray")


def _run_options(args, device: str, suite=None):
    """The run's options; `--executor` and `--ray-address` fall back to the suite file's `executor`/`ray_address`."""
    from bench.isolation import RunOptions

    executor = _check_choice("executor", args.executor or getattr(suite, "executor", None) or "local", EXECUTORS)
    isolate = args.isolate if getattr(args, "isolate", None) is not None else device == "cuda"
    return RunOptions(isolate=isolate or executor == "ray", repeats=getattr(args, "repeats", 1),
                      threads=getattr(args, "threads", None), deterministic=getattr(args, "deterministic", False),
                      executor=executor, ranks=getattr(args, "ranks", 1))


def _executor(args, options, suite=None):
    """The runner's executor for `options.executor` (bench.runner.local_executor, or a RayExecutor)."""
    from bench.runner import local_executor

    if options.executor != "ray":
        if args.ray_address:
            raise UsageError("--ray-address needs --executor ray")
        return local_executor
    from bench.ray_executor import RayExecutor, import_ray

    import_ray()  # a missing package is an error before any case
    return RayExecutor(args.ray_address or getattr(suite, "ray_address", None))


def _suite_from_args(args, device: str, strategies: list[str] | None):
    """The suite to run: the suite file if given, with any command-line option taking precedence."""
    from bench.suite import Suite, check_data, load_suite, validate

    suite = load_suite(args.suite, device) if getattr(args, "suite", None) else Suite()
    overrides = {}
    if strategies is not None:
        overrides["strategies"] = strategies
    if args.workload:
        from workloads import get_workload

        overrides["workloads"] = _csv_list(args.workload)
        for spec in overrides["workloads"]:
            try:
                get_workload(spec)
            except UsageError as error:
                raise UsageError(f"--workload: {error}") from None
    if args.data:
        overrides["data"] = args.data
    if args.phases:
        overrides["phases"] = _csv_list(args.phases)
    if args.batch_size:
        overrides["batch_sizes"] = _batch_sizes(args.batch_size)
    if args.quick:
        overrides.update(warmup=1, steps=3)
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.warmup is not None:
        overrides["warmup"] = args.warmup
    validate(overrides, "command line")
    for key, value in overrides.items():
        setattr(suite, key, value)
    return check_data(suite, "command line")


def _progress(index: int, total: int, case, row) -> None:
    prefix = f"[{index + 1:>{len(str(total))}}/{total}] {case.label()}"
    if row is None:
        print(f"{prefix} ...", file=sys.stderr, flush=True)
        return
    if row["status"] != "ok":
        print(f"{prefix}: {row['status']} {row['message']}", file=sys.stderr, flush=True)
        return
    mib = row["peak_mem_bytes"] / 2**20
    match = "" if row.get("matches_baseline") else "  DOES NOT MATCH BASELINE"
    print(f"{prefix}: {row['step_time_ms_median']:.1f} ms/step, peak {mib:.1f} MiB{match}",
          file=sys.stderr, flush=True)


def _run_suite(args, suite, device: str) -> int:
    """Runs the suite's cases into a new CSV under --out, or, with --resume, the unfinished ones into that CSV;
    prints the table."""
    from bench.results import new_run_id, to_frame
    from bench.runner import run_cases

    options = _run_options(args, device, suite)
    executor = _executor(args, options, suite)
    cases = suite.cases(device)
    previous, run_id = None, None
    if args.resume:
        from bench.resume import load_resume

        resumed = load_resume(args.resume, cases, options)
        out_path, previous, run_id = resumed.path, resumed.rows, resumed.run_id
        print(f"resuming {out_path}: {len(previous)} finished, {len(resumed.remaining)} to run",
              file=sys.stderr, flush=True)
        cases = resumed.remaining
    else:
        out_path = Path(args.out) / f"{new_run_id(device)}.csv"
    rows = run_cases(cases, out_path, progress=_progress, options=options, previous_rows=previous, run_id=run_id,
                     executor=executor)
    print(format_table(to_frame(rows)))
    print(f"\nwrote {out_path}")
    return 0


def format_table(frame) -> str:
    """The console table: per workload, one line per case, memory and time relative to that workload's baseline."""
    header = f"{'strategy':<32} {'phase':<5} {'batch':>5} {'peak MiB':>9} {'vs base':>7} " \
             f"{'step ms':>9} {'± IQR':>7} {'95% CI ms':>15} {'vs base':>7} {'matches':>7}  status"
    lines = []
    any_noisy = False
    for (workload, data), rows in frame.groupby(["workload", "data"], sort=False, dropna=False):
        if lines:
            lines.append("")
        lines += [f"workload {workload} (data {data})", header, "-" * len(header)]
        for _, r in rows.iterrows():
            line, noisy = _table_line(r)
            lines.append(line)
            any_noisy |= noisy
    if any_noisy:
        lines.append(f"~ noisy: the 95% CI of the step time is wider than {_noise_threshold():.0%} of the median")
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


def pd_num(column):
    import pandas as pd

    return pd.to_numeric(column, errors="coerce").fillna(0)


def _ci(r) -> str:
    low, high = r.get("step_time_ms_ci95_low"), r.get("step_time_ms_ci95_high")
    if low is None or high is None or low != low or high != high or r["status"] != "ok":
        return "-"
    return f"[{low:.1f}, {high:.1f}]"


def _noise_threshold() -> float:
    from bench.stats import NOISE_THRESHOLD

    return NOISE_THRESHOLD


# --- subcommands -----------------------------------------------------------------------------------------

def cmd_list(args) -> int:
    """Workloads and strategies with one-line descriptions."""
    from strategies import STRATEGIES
    from workloads import WORKLOADS, workload_names

    print("workloads (options with name:option=value; your own model: path/to/file.py:NAME):")
    for name in workload_names():
        cls = WORKLOADS.get(name)
        details = [f"data: {', '.join(cls.data_sources)}", f"batch {cls.default_batch_size}"]
        if cls.options:
            details.append("options: " + ", ".join(f"{k}={v}" for k, v in cls.options.items()))
        print(f"  {name:<20} {cls.description} [{'; '.join(details)}]")
    print("strategies (combine with +, options with name:option=value):")
    for name in STRATEGIES:
        cls = STRATEGIES.get(name)
        options = ", ".join(f"{k}={v}" for k, v in cls.options.items())
        print(f"  {name:<20} {cls.description}" + (f" [options: {options}]" if options else ""))
    return 0


def cmd_env(args) -> int:
    """The environment as every results row records it."""
    from bench.env import environment, resolve_device

    device = resolve_device(args.device)
    print(f"{'device':<16} {device}")
    for key, value in environment(device).items():
        print(f"{key:<16} {value}")
    return 0


def cmd_run(args) -> int:
    """Runs a suite file, or the strategies given with --strategies."""
    from bench.env import resolve_device

    if not args.suite and not args.strategies:
        raise UsageError("run needs --suite FILE or --strategies a,b (see `python -m bench list`)")
    device = resolve_device(args.device)
    apply_memory_limit(getattr(args, "memory_limit", None), device)
    strategies = _csv_list(args.strategies) if args.strategies else None
    return _run_suite(args, _suite_from_args(args, device, strategies), device)


def cmd_compare(args) -> int:
    """Baseline plus the named strategies: a console table relative to baseline, and the CSV."""
    from bench.env import resolve_device

    device = resolve_device(args.device)
    apply_memory_limit(getattr(args, "memory_limit", None), device)
    return _run_suite(args, _suite_from_args(args, device, _csv_list(args.strategies)), device)


def cmd_report(args) -> int:
    """Draws the charts and REPORT.md from results CSVs alone (default: the newest CSV in results/)."""
    from bench.report import build_report, newest_csv, parse_size

    try:
        budget = parse_size(args.budget) if args.budget else None
    except ValueError as error:
        raise UsageError(f"bad --budget {args.budget!r}: {error}") from None
    if args.csv:
        paths = [Path(p) for p in args.csv]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise UsageError(f"no such results file {missing[0]!r}")
    else:
        try:
            paths = [newest_csv(Path(args.results))]
        except FileNotFoundError:
            raise UsageError(f"no results CSV in {args.results!r}; run `python -m bench compare` first") from None
    report = build_report(paths, Path(args.out) if args.out else paths[0].parent, budget)
    print(f"wrote {report}")
    return 0


# --- memory analysis: explain, predict, fit, --memory-limit ------------------------------------------------

def _one_batch_size(text) -> int:
    sizes = _batch_sizes(text)
    if len(sizes) != 1:
        raise UsageError(f"bad batch size {text!r}; this command takes one batch size")
    return sizes[0]


def _check_choice(kind: str, value: str, choices) -> str:
    if value not in choices:
        raise choices_error(kind, value, choices)
    return value


def _analysis_device(text: str) -> str:
    return _check_choice("device", text, ("cpu", "cuda"))


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
                        "on the CPU a warning and no effect")


def apply_memory_limit(limit: str | None, device: str) -> float | None:
    """`--memory-limit`: torch.cuda.set_per_process_memory_fraction; on the CPU a warning line, nothing else.

    Returns the fraction set (None when nothing was set)."""
    if limit is None:
        return None
    from bench.analysis import parse_bytes

    try:
        value = float(limit)
    except ValueError:
        value = None
    if value is not None and 0 < value <= 1:
        fraction = value
        nbytes = None
    else:
        nbytes = parse_bytes(limit)
        fraction = None
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
    from bench import analysis
    from bench.errors import Unsupported
    from bench.rule_of_thumb import rule_of_thumb
    from bench.runner import Case, bind_case

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
    result = analysis.explain(case, strategy)
    print(analysis.format_explain(case, result["memory"], result["modules"],
                                  rule_of_thumb(workload, phase, batch)))
    return 0


def cmd_predict(args) -> int:
    """Predicted torch.cuda.max_memory_allocated per case, without a GPU (assumptions printed); writes a CSV."""
    import pandas as pd

    from bench import predict
    from bench.results import new_run_id, write_csv_atomic
    from bench.runner import Case
    from strategies import parse_strategy

    workload, data = _workload_and_data(args)
    device = _analysis_device(args.device)
    engine = _check_choice("engine", args.engine, predict.ENGINES)
    phases = [_check_choice("phase", p, ("train", "eval")) for p in _csv_list(args.phases)]
    specs = ["baseline"] + [s for s in _csv_list(args.strategies or "") if s != "baseline"]
    for spec in specs:
        parse_strategy(spec)  # unknown names: exit 2 before any work
    rows = []
    for spec in specs:
        for phase in phases:
            for batch in _batch_sizes(args.batch_size):
                rows.append(predict.predict_case(Case(workload, spec, phase, batch, device, data=data), engine,
                                                 args.ranks))
    print(f"predicted peak memory on {device}" + (" (torch.cuda.max_memory_allocated)" if device == "cuda" else
                                                  " (exact live tensor bytes)"))
    print(predict.format_predictions(rows))
    if device == "cuda":
        print("\nassumptions:")
        for line in predict.ASSUMPTIONS:
            print(f"  - {line}")
    path = Path(args.out) / f"predict-{new_run_id(device)}.csv"
    write_csv_atomic(pd.DataFrame(rows), path)
    print(f"\nwrote {path}")
    return 0


def cmd_fit(args) -> int:
    """The largest batch size under a memory budget, per strategy (baseline always), each verified by a run."""
    import pandas as pd

    from bench import analysis
    from bench.results import new_run_id, write_csv_atomic
    from strategies import parse_strategy

    budget = analysis.parse_bytes(args.budget)
    workload, data = _workload_and_data(args)
    device = _analysis_device(args.device)
    if device == "cuda":
        from bench.env import resolve_device
        resolve_device("cuda")
    phase = _check_choice("phase", args.phase, ("train", "eval"))
    max_batch = _one_batch_size(args.max_batch)
    specs = _csv_list(args.strategies or "")
    for spec in specs:
        parse_strategy(spec)
    if args.time_steps < 0:
        raise UsageError("--time-steps must be 0 or more")
    apply_memory_limit(args.memory_limit, device)
    results = analysis.fit(specs, budget, phase, device, workload, data, max_batch, args.time_steps)
    print(f"largest batch with peak <= {args.budget} ({budget:,} B) on {device}, phase {phase}")
    print(analysis.format_fit(results, args.time_steps))
    path = Path(args.out) / f"fit-{new_run_id(device)}.csv"
    write_csv_atomic(pd.DataFrame(analysis.fit_rows(results)), path)
    print(f"\nwrote {path}")
    return 0


def _add_table_options(p: argparse.ArgumentParser) -> None:
    """Options of the commands that write a table of their own (predict, fit)."""
    p.add_argument("--data", default=None, help="a data source of the workload (default synthetic where it has one)")
    p.add_argument("--workload", default=None, help=WORKLOAD_HELP)
    p.add_argument("--out", default="results", help="folder for the CSV (default results/)")


def _add_analysis_parsers(sub) -> None:
    p = sub.add_parser("explain", help=cmd_explain.__doc__)
    p.add_argument("--strategy", required=True, help="one strategy spec, e.g. baseline or checkpoint+amp")
    p.add_argument("--phase", default="train", help="train or eval (default train)")
    p.add_argument("--batch-size", default="100", help="default 100")
    p.add_argument("--device", default="cpu", help="cpu (the exact tracker)")
    p.add_argument("--data", default=None, help="a data source of the workload (default synthetic where it has one: "
                                                 "memory does not depend on the values)")
    p.add_argument("--workload", default=None, help=WORKLOAD_HELP)
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("predict", help=cmd_predict.__doc__)
    p.add_argument("--strategies", default="", help="comma list (baseline is always included)")
    p.add_argument("--device", default="cuda", help="cuda (default: predict CUDA on any machine) or cpu")
    p.add_argument("--batch-size", default="100", help="one size or a comma list (default 100)")
    p.add_argument("--phases", default="train,eval", help="default train,eval")
    p.add_argument("--ranks", type=_positive_int, default=1,
                   help="for the sharded strategies (ddp, zero1, fsdp): the peak of one rank of N, without starting "
                        "N processes (PyTorch's fake process group)")
    p.add_argument("--engine", default="auto", help="auto (CPU up to batch 16, else meta with the CPU as fallback), meta or cpu")
    _add_table_options(p)
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser("fit", help=cmd_fit.__doc__)
    p.add_argument("--budget", required=True, help="memory budget: 4GiB, 512MiB, 1e9 ...")
    p.add_argument("--strategies", default="", help="comma list (baseline is always included)")
    p.add_argument("--device", default="cpu", help="cpu (exact tracker) or cuda (real attempts)")
    p.add_argument("--phase", default="train", help="train or eval (default train)")
    p.add_argument("--max-batch", default="4096", help="largest batch size tried (default 4096)")
    p.add_argument("--time-steps", type=int, default=1, help="timed steps at the largest batch (0: no timing)")
    _add_table_options(p)
    _add_memory_limit_option(p)
    p.set_defaults(func=cmd_fit)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="{list,env,run,compare,report,explain,predict,fit}")
    sub.required = True

    p = sub.add_parser("list", help=cmd_list.__doc__)
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("env", help=cmd_env.__doc__)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.set_defaults(func=cmd_env)

    p = sub.add_parser("run", help=cmd_run.__doc__)
    p.add_argument("--suite", default=None, help="a suite YAML file (e.g. bench/suites/default.yaml)")
    p.add_argument("--strategies", default=None, help="comma list of strategies, e.g. checkpoint,amp,checkpoint+amp")
    _add_case_options(p)
    _add_memory_limit_option(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("compare", help=cmd_compare.__doc__)
    p.add_argument("--strategies", required=True, help="comma list, e.g. checkpoint,amp (baseline is always run)")
    _add_case_options(p)
    _add_memory_limit_option(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("report", help=cmd_report.__doc__)
    p.add_argument("csv", nargs="*", help="results CSV files (default: the newest in --results)")
    p.add_argument("--results", default="results", help="where to look for the newest CSV (default results/)")
    p.add_argument("--out", default=None, help="where to write the charts and REPORT.md (default: the CSV's folder)")
    p.add_argument("--budget", default=None, help="a memory budget line for the batch-size chart, e.g. 4GiB")
    p.set_defaults(func=cmd_report)
    _add_analysis_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the results CSV holds every case that finished", file=sys.stderr)
        return 130
