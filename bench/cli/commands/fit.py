"""`fit`: the largest batch (or, `--over seq_len`, the longest sequence) whose peak stays under a memory budget, per
strategy (bench.cli.commands_analysis, bench.analysis.fit and fit_seq_len)."""

from __future__ import annotations

from bench.cli.arguments import (add_executor_options, add_memory_limit_option, add_seq_len_options,
                                 add_table_options, add_threads_option, non_negative_int)
from bench.cli.command import Command
from bench.cli.config_option import add_config_option


def add_arguments(parser) -> None:
    parser.add_argument("--budget", default=None, help="memory budget: 4GiB, 512MiB, 1e9 ... (default: the --gpu's "
                                                       "memory; one of the two is required)")
    parser.add_argument("--gpu", default=None,
                        help="fit on this GPU of `plan --list-gpus`: its memory is the budget, its compute capability "
                             "sizes the kernels' workspaces; implies --device cuda (default: none)")
    parser.add_argument("--strategies", default=None,
                        help="comma list (baseline is always included; default: baseline only)")
    parser.add_argument("--device", default=None, help="cpu (exact count) or cuda (real attempts on a GPU, "
                                                       "predictions without one) (default: cuda with --gpu, else cpu)")
    parser.add_argument("--over", default="batch",
                        help="the axis searched: batch (the largest batch) or seq_len (the longest sequence at "
                             "--batch-size, on predictions; a workload with a seq_len option, e.g. hf:llama-3.1-8b) "
                             "(default batch)")
    parser.add_argument("--batch-size", default=None, help="--over seq_len: the batch (default 1)")
    add_seq_len_options(parser)
    add_config_option(parser)
    parser.add_argument("--phase", default="train", help="train or eval (default train)")
    parser.add_argument("--max-batch", default="4096", help="largest batch size tried (default 4096)")
    parser.add_argument("--time-steps", type=non_negative_int, default=1,
                        help="timed steps at the largest batch (0: no timing; default 1)")
    add_table_options(parser)
    add_memory_limit_option(parser)
    add_threads_option(parser)
    add_executor_options(parser, "probes (fake-tensor counts of a batch, predictions of a sequence length)",
                         jobs=True)


def run(args) -> int:
    from bench.core.collector import imported_paused

    # torch and the models, imported only when the command runs
    return imported_paused("bench.cli.commands_analysis", "cmd_fit")(args)


COMMAND = Command("fit", "find the largest batch size whose peak stays under a memory budget, per strategy, "
                         "confirmed by a run", add_arguments, run)
