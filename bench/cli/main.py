"""`python -m bench`: builds the parser of every command, dispatches to the command, and turns a usage error or an
interrupt into its one line and exit code.

The CLI parses, checks every value before anything runs (bench.run.preflight), dispatches and prints; the commands
live in bench.cli.commands_run (run, compare, list, env), commands_report, commands_analysis (explain, predict,
fit), commands_plan (plan), commands_anchors (anchors) and commands_cuda_env (cuda-env).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, Sequence

from bench.cli import interrupt
from bench.cli.config_option import add_config_option
from bench.cli.arguments import (DEFAULT_OUT, WORKLOAD_HELP, add_case_options, add_executor_options,
                                 add_global_batch_option, add_memory_limit_option, add_snapshot_option,
                                 add_table_options, add_threads_option, headroom_fraction, non_negative_int,
                                 positive_float, positive_int, refuse_blank_values, sharded_strategy_names)
from bench.core import gpus
from bench.core.errors import UsageError, shortened
from bench.core.job_environment import CUDA_ENV_VARIABLE, check_job_environment
from bench.core.processes import exit_status
from bench.measure.resident import pin_mmap_threshold

DESCRIPTION = ("Measures what each PyTorch memory-saving technique saves and costs (peak memory, step time, whether "
               "the result still matches the baseline) on a model you choose, on this machine. Results go to "
               f"{DEFAULT_OUT}/ unless --out says otherwise; `python -m bench <command> --help` for each command.")

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
    "plan": "find the fastest combination of techniques whose step fits a memory limit (--budget or --gpu), "
            "predicted, with --confirm measured",
    "anchors": "predict every published GPU measurement of bench/anchors/ on fake CUDA and print each error",
    "cuda-env": "build the fake-CUDA environment in which CUDA predictions trace CUDA's own operators without a GPU "
                "(PyPI's CUDA build of torch over stub CUDA libraries; needs the network and a C compiler)",
}

# Each command's function as (module, name), imported only when that command runs: `report` (drawn on any machine
# from a copied results folder), `--help` and a usage error then never import torch, which the others load.
COMMANDS = {
    "list": ("bench.cli.commands_run", "cmd_list"),
    "env": ("bench.cli.commands_run", "cmd_env"),
    "run": ("bench.cli.commands_run", "cmd_run"),
    "compare": ("bench.cli.commands_run", "cmd_compare"),
    "report": ("bench.cli.commands_report", "cmd_report"),
    "explain": ("bench.cli.commands_analysis", "cmd_explain"),
    "predict": ("bench.cli.commands_analysis", "cmd_predict"),
    "fit": ("bench.cli.commands_analysis", "cmd_fit"),
    "plan": ("bench.cli.commands_plan", "cmd_plan"),
    "anchors": ("bench.cli.commands_anchors", "cmd_anchors"),
    "cuda-env": ("bench.cli.commands_cuda_env", "cmd_cuda_env"),
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2 (no usage dump)."""

    def error(self, message: str):
        raise UsageError(message)


def command_function(name: str) -> Callable[[argparse.Namespace], int]:
    """The function that runs command `name` (its module imported now)."""
    module, function = COMMANDS[name]
    return getattr(importlib.import_module(module), function)


def _add_command(sub, name: str) -> argparse.ArgumentParser:
    description = COMMAND_HELP[name][0].upper() + COMMAND_HELP[name][1:] + "."
    return sub.add_parser(name, help=COMMAND_HELP[name], description=description)


def _add_run_parsers(sub) -> None:
    """list, env, run, compare and report."""
    _add_command(sub, "list")

    p = _add_command(sub, "env")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")

    p = _add_command(sub, "run")
    p.add_argument("--suite", default=None, help="a suite YAML file, e.g. bench/suites/default.yaml (what `make "
                                                 "bench` runs); default: none, give --strategies")
    p.add_argument("--strategies", default=None, help="comma list of strategies, e.g. checkpoint,amp,checkpoint+amp "
                                                      "(default: the suite's)")
    add_case_options(p)
    add_memory_limit_option(p)

    p = _add_command(sub, "compare")
    p.add_argument("--strategies", required=True, help="comma list, e.g. checkpoint,amp (baseline is always run)")
    add_case_options(p)
    add_memory_limit_option(p)

    p = _add_command(sub, "report")
    p.add_argument("csv", nargs="*", help="results CSV files (default: the newest in --results)")
    p.add_argument("--results", default=DEFAULT_OUT, help=f"where to look for the newest CSV (default {DEFAULT_OUT}/)")
    p.add_argument("--out", default=None, help="where to write the charts and REPORT.md (default: the CSV's folder)")
    p.add_argument("--budget", default=None, help="a memory budget line for the batch-size chart, e.g. 4GiB "
                                                  "(default: none)")
    p.add_argument("--html", action="store_true",
                   help="also write REPORT.html beside REPORT.md: one self-contained page (no network) with the "
                        "sortable table, interactive charts and the memory timeline of each case with a snapshot "
                        "(needs plotly: pip install membench[report]) (default off)")


def _add_analysis_parsers(sub) -> None:
    """explain, predict and fit."""
    p = _add_command(sub, "explain")
    p.add_argument("--strategy", required=True, help="one strategy spec, e.g. baseline or checkpoint+amp")
    p.add_argument("--phase", default="train", help="train or eval (default train)")
    p.add_argument("--batch-size", default=None, help="one batch size (default: the workload's own, see `list`)")
    p.add_argument("--device", default="cpu", help="cpu, the only choice: the breakdown needs the exact CPU count "
                                                   "(default cpu)")
    p.add_argument("--data", default=None, help="a data source of the workload (default synthetic where it has one: "
                                                 "memory does not depend on the values)")
    p.add_argument("--workload", default=None, help=WORKLOAD_HELP)
    p.add_argument("--out", default=DEFAULT_OUT, help=f"folder for --snapshot's file (default {DEFAULT_OUT}/)")
    add_snapshot_option(p, "into --out, in explain-<run>.snapshots/")
    add_threads_option(p)

    p = _add_command(sub, "predict")
    p.add_argument("--strategies", default=None,
                   help="comma list (baseline is always included; default: baseline only)")
    p.add_argument("--device", default="cuda", help="cuda (predict CUDA on any machine) or cpu (default cuda)")
    p.add_argument("--batch-size", default=None,
                   help="one size or a comma list (default: the workload's own, see `list`); with --ranks N, each "
                        "rank's")
    add_global_batch_option(p, many=True)
    p.add_argument("--phases", default=None, help="train,eval, train or eval (default train,eval; with --config, "
                                                  "train)")
    p.add_argument("--ranks", type=positive_int, default=1,
                   help=f"for the sharded strategies ({', '.join(sharded_strategy_names())}): the peak of the largest "
                        "of N ranks, each "
                        "training on its own --batch-size (or its share of --global-batch-size), without starting N "
                        "processes (PyTorch's fake process group; default 1)")
    p.add_argument("--engine", default="auto",
                   help="auto (fake tensors: for CUDA on CUDA's own operators where the fake-CUDA environment exists, "
                        "`python -m bench cuda-env` builds it, else on the CPU's; a real CPU step where they cannot "
                        "run a strategy), fake-cuda, fake, meta or cpu (default auto)")
    p.add_argument("--capability", default=None,
                   help="compute capability of the CUDA device predicted, e.g. 9.0 (sizes cuBLAS's workspace; "
                        "default: this machine's GPU, else a non-Hopper one)")
    p.add_argument("--gpu", default=None, help="predict for this GPU of `plan --list-gpus`: its compute capability "
                                               "(unless --capability), and whether each case fits its memory "
                                               "(reserved + the CUDA context, as `plan` judges) (default: none)")
    add_table_options(p)
    add_config_option(p)
    add_snapshot_option(p, "beside the predict CSV, in predict-<run>.snapshots/ (on CUDA the modelled allocator's "
                           "blocks and segments)")
    add_threads_option(p)

    p = _add_command(sub, "fit")
    p.add_argument("--budget", default=None, help="memory budget: 4GiB, 512MiB, 1e9 ... (default: the --gpu's "
                                                  "memory; one of the two is required)")
    p.add_argument("--gpu", default=None, help="fit on this GPU of `plan --list-gpus`: its memory is the budget, its "
                                               "compute capability sizes the kernels' workspaces; implies --device "
                                               "cuda (default: none)")
    p.add_argument("--strategies", default=None,
                   help="comma list (baseline is always included; default: baseline only)")
    p.add_argument("--device", default=None, help="cpu (exact count) or cuda (real attempts on a GPU, predictions "
                                                  "without one) (default: cuda with --gpu, else cpu)")
    p.add_argument("--over", default="batch", help="the axis searched: batch (the largest batch) or seq_len (the "
                                                   "longest sequence at --batch-size, on predictions; a workload "
                                                   "with a seq_len option, e.g. hf:llama-3.1-8b) (default batch)")
    p.add_argument("--batch-size", default=None, help="--over seq_len: the batch (default 1)")
    _add_seq_len_options(p)
    add_config_option(p)
    p.add_argument("--phase", default="train", help="train or eval (default train)")
    p.add_argument("--max-batch", default="4096", help="largest batch size tried (default 4096)")
    p.add_argument("--time-steps", type=non_negative_int, default=1,
                   help="timed steps at the largest batch (0: no timing; default 1)")
    add_table_options(p)
    add_memory_limit_option(p)
    add_threads_option(p)
    add_executor_options(p, "probes (fake-tensor counts of a batch, predictions of a sequence length)", jobs=True)


def _add_seq_len_options(p) -> None:
    """The lengths `--over seq_len` tries (fit and plan)."""
    p.add_argument("--seq-step", type=positive_int, default=256,
                   help="--over seq_len: the answer is a multiple of this many tokens (default 256)")
    p.add_argument("--max-seq-len", type=positive_int, default=None,
                   help="--over seq_len: the longest sequence tried (default: the model's max_position_embeddings)")


def _add_plan_parser(sub) -> None:
    """plan."""
    p = _add_command(sub, "plan")
    p.add_argument("--workload", default=None, help=WORKLOAD_HELP)
    add_config_option(p)
    p.add_argument("--data", default=None, help="a data source of the workload (default synthetic where it has one)")
    p.add_argument("--batch-size", default=None, help="one batch size (default: the workload's own, see `list`); "
                                                       "with --ranks or --max-ranks, each rank's")
    add_global_batch_option(p)
    p.add_argument("--budget", default=None, help="memory limit: 4GiB, 500MiB, 1e9 ... (default: the --gpu's memory)")
    p.add_argument("--gpu", default=None, help="plan for this GPU of the table (`--list-gpus`): its memory is the "
                                               "limit, its figures time the step; implies --device cuda (default: "
                                               "none, give --budget)")
    p.add_argument("--list-gpus", action="store_true", help="print the GPU table and exit (default off)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda with --gpu, else cpu)")
    p.add_argument("--headroom", type=headroom_fraction, default=gpus.DEFAULT_HEADROOM,
                   help=f"fraction of the limit kept free (default {gpus.DEFAULT_HEADROOM:g})")
    p.add_argument("--ranks", type=positive_int, default=1,
                   help="plan for N ranks: the sharded strategies become candidates (default 1)")
    p.add_argument("--strategies", default=None,
                   help="comma list: only these strategies' settings and their combinations are candidates (default: "
                        "every strategy the planner tries)")
    p.add_argument("--max-ranks", type=positive_int, default=None,
                   help="how many GPUs: plan on 1, 2, 4, ... up to N ranks, then halve the gap below the first "
                        "count with a plan that fits down to 3 counts, try those, and answer the fewest (default: "
                        "off, plan for --ranks)")
    p.add_argument("--over", default="batch",
                   help="batch (the fastest plan at --batch-size) or seq_len (the plan that trains the longest "
                        "sequence at --batch-size, default 1; a workload with a seq_len option) (default batch)")
    _add_seq_len_options(p)
    p.add_argument("--allow-different", action="store_true",
                   help="let candidates that change what is trained (another optimizer, BatchNorm over micro-"
                        "batches) be the answer (default off: marked and kept out)")
    p.add_argument("--max-candidates", type=positive_int, default=gpus.DEFAULT_MAX_CANDIDATES,
                   help=f"candidates predicted at most (default {gpus.DEFAULT_MAX_CANDIDATES})")
    p.add_argument("--max-search-s", type=positive_float, default=gpus.DEFAULT_MAX_SEARCH_S, metavar="SECONDS",
                   help=f"no candidate starts after this many seconds of search (default "
                        f"{gpus.DEFAULT_MAX_SEARCH_S:g})")
    p.add_argument("--jobs", type=positive_int, default=None,
                   help="processes predicting candidates at once (default: the cores this process may use, at most "
                        "4; with --executor ray the cluster's CPUs)")
    p.add_argument("--confirm", action="store_true",
                   help="measure the answer with the harness (the planned device must be this machine's: the CPU, or "
                        "a GPU here; default off)")
    p.add_argument("--confirm-front", action="store_true", help="measure the answer and every candidate on the "
                                                                "Pareto front (default off)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"folder for the CSV and the chart (default {DEFAULT_OUT}/)")
    add_threads_option(p)
    add_executor_options(p, "candidates")


def _add_cuda_env_parser(sub) -> None:
    """cuda-env."""
    p = _add_command(sub, "cuda-env")
    p.add_argument("--path", default=None,
                   help=f"the environment's folder (default: where `predict` looks for it, ${CUDA_ENV_VARIABLE} or, "
                        "in a checkout, .venv-cuda-fake, else membench-cuda-env in the environment membench is "
                        "installed in); run it again after upgrading membench")
    p.add_argument("--torch-version", default=None,
                   help="the torch release whose CUDA build is installed (default: the torch installed here)")
    p.add_argument("--torchvision-version", default=None,
                   help="the torchvision release built for it, for the `timm:` workload (default: the torchvision "
                        "installed here; without one the `timm:` workload is left out)")


def build_parser() -> argparse.ArgumentParser:
    """The parser of `python -m bench` and its commands; `args.command` names the command given."""
    parser = _Parser(prog="python -m bench", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="{" + ",".join(COMMAND_HELP) + "}")
    sub.required = True
    _add_run_parsers(sub)
    _add_analysis_parsers(sub)
    _add_plan_parser(sub)
    p = _add_command(sub, "anchors")
    p.add_argument("--only", default=None, help="comma list of anchor or source names, e.g. torchao or "
                                               "transformers-vanilla (default: every anchor)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"folder for anchors-<run>.csv (default {DEFAULT_OUT}/)")
    p.add_argument("--jobs", type=positive_int, default=1,
                   help="anchors predicted at once, each in its own fake-CUDA process (their figures do not depend "
                        "on it; each process needs up to 2 GB resident) (default 1)")
    _add_cuda_env_parser(sub)
    refuse_blank_values(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; exit code 2 for a usage error (one line on stderr), 130 for an interrupt (143 SIGTERM, 129
    SIGHUP)."""
    interrupt.start(sys.argv[1:] if argv is None else argv)
    try:
        pin_mmap_threshold()  # before anything grows the heap (bench.measure.resident)
        args = build_parser().parse_args(argv)  # --help ends here with argparse's SystemExit(0), as it should
        check_job_environment(args.command)
        try:
            return command_function(args.command)(args)
        except SystemExit as error:  # no command of ours exits: a user's workload code called sys.exit
            print(f"error: the workload's code called sys.exit({error.code!r}) during `{args.command}`, which "
                  "stopped it there; the workload must return, not exit", file=sys.stderr)
            return 1
    except UsageError as error:
        print(f"error: {shortened(str(error))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stopped:  # Ctrl-C, or SIGTERM/SIGHUP under `python -m bench` (bench/__main__.py)
        print(f"\n{interrupt.note()}", file=sys.stderr)
        return exit_status(stopped)
