"""`python -m bench {list,env,run,compare,report}`: one `cmd_<name>` function per subcommand."""

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


def _run_suite(suite, device: str, out: str):
    from bench.results import new_run_id, to_frame
    from bench.runner import run_cases

    cases = suite.cases(device)
    out_path = Path(out) / f"{new_run_id(device)}.csv"
    rows = run_cases(cases, out_path, progress=_progress)
    return to_frame(rows), out_path


def format_table(frame) -> str:
    """The console table: one line per case, memory and time relative to the baseline."""
    header = f"{'strategy':<32} {'phase':<5} {'batch':>5} {'peak MiB':>9} {'vs base':>7} " \
             f"{'step ms':>9} {'± IQR':>7} {'vs base':>7} {'matches':>7}  status"
    lines = [header, "-" * len(header)]
    for _, r in frame.iterrows():
        def num(value, fmt):
            return fmt.format(value) if value == value and value is not None else "-"
        mib = r["peak_mem_bytes"] / 2**20 if r["status"] == "ok" else float("nan")
        match = {True: "yes", False: "NO"}.get(r["matches_baseline"], "-")
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['message']}"
        lines.append(f"{r['strategy']:<32} {r['phase']:<5} {r['batch_size']:>5} {num(mib, '{:.1f}'):>9} "
                     f"{num(r['mem_vs_baseline'], RELATIVE_FORMAT):>7} {num(r['step_time_ms_median'], '{:.1f}'):>9} "
                     f"{num(r['step_time_ms_iqr'], '{:.1f}'):>7} {num(r['time_vs_baseline'], RELATIVE_FORMAT):>7} "
                     f"{match:>7}  {status}")
    return "\n".join(lines)


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
    frame, path = _run_suite(suite, device, args.out)
    print(format_table(frame))
    print(f"\nwrote {path}")
    return 0


def cmd_compare(args) -> int:
    """Baseline plus the named strategies: a console table relative to baseline, and the CSV."""
    from bench.env import resolve_device

    device = resolve_device(args.device)
    suite = _suite_from_args(args, device, _csv_list(args.strategies))
    frame, path = _run_suite(suite, device, args.out)
    print(format_table(frame))
    print(f"\nwrote {path}")
    return 0


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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="{list,env,run,compare,report}")
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

    p = sub.add_parser("report", help=cmd_report.__doc__)
    p.add_argument("csv", nargs="*", help="results CSV files (default: the newest in --results)")
    p.add_argument("--results", default="results", help="where to look for the newest CSV (default results/)")
    p.add_argument("--out", default=None, help="where to write the charts and REPORT.md (default: the CSV's folder)")
    p.add_argument("--budget", default=None, help="a memory budget line for the batch-size chart, e.g. 4GiB")
    p.set_defaults(func=cmd_report)
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
