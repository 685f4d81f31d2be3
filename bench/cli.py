"""`python -m bench {list,env,run,compare}`: one `cmd_<name>` function per subcommand."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from bench.errors import UsageError, choices_error

RELATIVE_FORMAT = "{:.2f}x"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2 (no usage dump)."""

    def error(self, message: str):
        raise UsageError(message)


# --- argument helpers ----------------------------------------------------------------------------------

def _batch_sizes(text: str) -> list[int]:
    sizes = []
    for part in str(text).split(","):
        try:
            value = int(part)
        except ValueError:
            raise UsageError(f"bad batch size {part!r}; expected positive integers such as 100 or 25,50,100") from None
        if value <= 0:
            raise UsageError(f"bad batch size {value}; a batch size must be a positive integer")
        sizes.append(value)
    return sizes


def _csv_list(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _add_case_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default=None, help="workload name (see `list`); default captcha_resnet18")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    p.add_argument("--batch-size", default=None, help="one size or a comma list, e.g. 25,50,100 (default 100)")
    p.add_argument("--phases", default=None, help="train,eval (default both)")
    p.add_argument("--steps", type=int, default=None, help="measured steps per case")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps before timing")
    p.add_argument("--data", default=None, help="captcha (real images) or synthetic (random tensors)")
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
    p.add_argument("--resume", default=None, metavar="CSV",
                   help="continue the run in this results CSV: skip its finished cases, run the rest into it")


def _run_options(args, device: str):
    from bench.isolation import RunOptions

    isolate = args.isolate if getattr(args, "isolate", None) is not None else device == "cuda"
    return RunOptions(isolate=isolate, repeats=getattr(args, "repeats", 1), threads=getattr(args, "threads", None),
                      deterministic=getattr(args, "deterministic", False))


def _suite_from_args(args, device: str, strategies: list[str] | None):
    """The suite to run: the suite file if given, with any command-line option taking precedence."""
    from bench.suite import Suite, load_suite, validate

    suite = load_suite(args.suite, device) if getattr(args, "suite", None) else Suite()
    overrides = {}
    if strategies is not None:
        overrides["strategies"] = strategies
    if args.workload:
        overrides["workload"] = args.workload
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
    return suite


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


def _run_suite(suite, device: str, out: str, options=None, resume: str | None = None):
    """Runs the suite's cases into a new CSV under `out`, or, with `resume`, the unfinished ones into that CSV."""
    from bench.results import new_run_id, to_frame
    from bench.runner import run_cases

    cases = suite.cases(device)
    previous, run_id = None, None
    if resume:
        from bench.resume import load_resume

        from bench.isolation import RunOptions

        resumed = load_resume(resume, cases, options or RunOptions())
        out_path, previous, run_id = resumed.path, resumed.rows, resumed.run_id
        print(f"resuming {out_path}: {len(previous)} finished, {len(resumed.remaining)} to run",
              file=sys.stderr, flush=True)
        cases = resumed.remaining
    else:
        out_path = Path(out) / f"{new_run_id(device)}.csv"
    rows = run_cases(cases, out_path, progress=_progress, options=options, previous_rows=previous, run_id=run_id)
    return to_frame(rows), out_path


def format_table(frame) -> str:
    """The console table: one line per case, memory and time relative to the baseline."""
    header = f"{'strategy':<32} {'phase':<5} {'batch':>5} {'peak MiB':>9} {'vs base':>7} " \
             f"{'step ms':>9} {'± IQR':>7} {'95% CI ms':>15} {'vs base':>7} {'matches':>7}  status"
    lines = [header, "-" * len(header)]
    any_noisy = False
    for _, r in frame.iterrows():
        def num(value, fmt):
            return fmt.format(value) if value == value and value is not None else "-"
        mib = r["peak_mem_bytes"] / 2**20 if r["status"] == "ok" else float("nan")
        match = {True: "yes", False: "NO"}.get(r["matches_baseline"], "-")
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['message']}"
        noisy = r.get("noisy") is True or str(r.get("noisy")).lower() == "true"
        noisy = noisy and r["status"] == "ok"
        any_noisy |= noisy
        step = num(r["step_time_ms_median"], "{:.1f}") + ("~" if noisy else "")
        lines.append(f"{r['strategy']:<32} {r['phase']:<5} {r['batch_size']:>5} {num(mib, '{:.1f}'):>9} "
                     f"{num(r['mem_vs_baseline'], RELATIVE_FORMAT):>7} {step:>9} "
                     f"{num(r['step_time_ms_iqr'], '{:.1f}'):>7} {_ci(r):>15} "
                     f"{num(r['time_vs_baseline'], RELATIVE_FORMAT):>7} {match:>7}  {status}")
    if any_noisy:
        lines.append(f"~ noisy: the 95% CI of the step time is wider than {_noise_threshold():.0%} of the median")
    if {"peak_mem_spread_bytes", "repeats"} <= set(frame.columns) and (pd_num(frame["repeats"]) > 1).any():
        spread = pd_num(frame["peak_mem_spread_bytes"]).where(frame["status"] == "ok")
        differ = frame.loc[spread > 0, "strategy"].tolist()
        lines.append("peak bytes across repeats: " + (f"DIFFER for {', '.join(map(str, differ))}" if differ
                                                     else "identical in every ok row (spread 0 B)"))
    return "\n".join(lines)


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
    from workloads import WORKLOADS

    print("workloads:")
    for name in WORKLOADS:
        print(f"  {name:<20} {WORKLOADS.get(name).description}")
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
    strategies = _csv_list(args.strategies) if args.strategies else None
    suite = _suite_from_args(args, device, strategies)
    frame, path = _run_suite(suite, device, args.out, _run_options(args, device), args.resume)
    print(format_table(frame))
    print(f"\nwrote {path}")
    return 0


def cmd_compare(args) -> int:
    """Baseline plus the named strategies: a console table relative to baseline, and the CSV."""
    from bench.env import resolve_device

    device = resolve_device(args.device)
    suite = _suite_from_args(args, device, _csv_list(args.strategies))
    frame, path = _run_suite(suite, device, args.out, _run_options(args, device), args.resume)
    print(format_table(frame))
    print(f"\nwrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="{list,env,run,compare}")
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
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("compare", help=cmd_compare.__doc__)
    p.add_argument("--strategies", required=True, help="comma list, e.g. checkpoint,amp (baseline is always run)")
    _add_case_options(p)
    p.set_defaults(func=cmd_compare)
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
