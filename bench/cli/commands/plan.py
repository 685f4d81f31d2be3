"""`plan`: the fastest combination of techniques whose step fits a memory limit, predicted, with --confirm measured
(bench.cli.commands_plan; `--over seq_len` in commands_plan_seq_len, several rank counts in commands_plan_ranks)."""

from __future__ import annotations

from bench.cli.arguments import (DEFAULT_OUT, WORKLOAD_HELP, add_executor_options, add_global_batch_option,
                                 add_seq_len_options, add_threads_option, headroom_fraction, positive_float,
                                 positive_int)
from bench.cli.command import Command
from bench.cli.config_option import add_config_option
from bench.core import gpus


def add_arguments(parser) -> None:
    p = parser
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
    p.add_argument("--gpus-per-node", type=positive_int, default=8, metavar="G",
                   help="GPUs in a node: on several ranks the dp x tp meshes tried keep each tensor-parallel group "
                        "inside a node (a tp degree dividing G), and a collective whose group spans nodes (G "
                        "consecutive ranks a node) is timed over the network instead of the GPU link (default 8)")
    p.add_argument("--over", default="batch",
                   help="batch (the fastest plan at --batch-size) or seq_len (the plan that trains the longest "
                        "sequence at --batch-size, default 1; a workload with a seq_len option) (default batch)")
    add_seq_len_options(p)
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


def run(args) -> int:
    from bench.core.collector import imported_paused

    # torch and the models, imported only when the command runs
    return imported_paused("bench.cli.commands_plan", "cmd_plan")(args)


COMMAND = Command("plan", "find the fastest combination of techniques whose step fits a memory limit (--budget or "
                          "--gpu), predicted, with --confirm measured", add_arguments, run)
