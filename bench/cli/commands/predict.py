"""`predict`: each strategy's peak memory (CUDA's by default) estimated without running on that device
(bench.cli.commands_analysis, bench.analysis.predict)."""

from __future__ import annotations

from bench.cli.arguments import (add_global_batch_option, add_snapshot_option, add_table_options, add_threads_option,
                                 positive_int, sharded_strategy_names)
from bench.cli.command import Command
from bench.cli.config_option import add_config_option


def add_arguments(parser) -> None:
    parser.add_argument("--strategies", default=None,
                        help="comma list; the baseline is predicted only where named (first) or where none is "
                             "(default: baseline only)")
    parser.add_argument("--device", default="cuda",
                        help="cuda (predict CUDA on any machine) or cpu (default cuda)")
    parser.add_argument("--batch-size", default=None,
                        help="one size or a comma list (default: the workload's own, see `list`); with --ranks N, "
                             "each rank's")
    add_global_batch_option(parser, many=True)
    parser.add_argument("--phases", default=None, help="train,eval, train or eval (default train,eval; with "
                                                       "--config, train)")
    parser.add_argument("--ranks", type=positive_int, default=1,
                        help=f"for the sharded strategies ({', '.join(sharded_strategy_names())}): the peak of the "
                             "largest of N ranks, each training on its own --batch-size (or its share of "
                             "--global-batch-size), without starting N processes (PyTorch's fake process group; "
                             "default 1)")
    parser.add_argument("--engine", default="auto",
                        help="auto (fake tensors: for CUDA on CUDA's own operators where the fake-CUDA environment "
                             "exists, `python -m bench cuda-env` builds it, else on the CPU's; a real CPU step where "
                             "they cannot run a strategy), fake-cuda, fake, meta or cpu (default auto)")
    parser.add_argument("--capability", default=None,
                        help="compute capability of the CUDA device predicted, e.g. 9.0 (sizes cuBLAS's workspace; "
                             "default: this machine's GPU, else a non-Hopper one)")
    parser.add_argument("--gpu", default=None,
                        help="predict for this GPU of `plan --list-gpus`: its compute capability (unless "
                             "--capability), and whether each case fits its memory (reserved + the CUDA context, as "
                             "`plan` judges) (default: none)")
    add_table_options(parser)
    add_config_option(parser)
    add_snapshot_option(parser, "beside the predict CSV, in predict-<run>.snapshots/ (on CUDA the modelled "
                                "allocator's blocks and segments)")
    add_threads_option(parser)


def run(args) -> int:
    from bench.core.collector import imported_paused

    # torch and the models, imported only when the command runs
    return imported_paused("bench.cli.commands_analysis", "cmd_predict")(args)


COMMAND = Command("predict", "estimate the peak memory of each strategy (CUDA's by default) without running on that "
                             "device", add_arguments, run)
