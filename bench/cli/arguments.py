"""The command line's options: their types, the groups of options commands share, and the checks of their values.

Nothing here imports torch: `--help`, a usage error and `report` stay quick and need no torch.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
from pathlib import Path
from typing import Any, Callable

from bench.core.errors import UsageError
from bench.core.units import parse_positive_size
from bench.run.preflight import (DEFAULT_MAX_TIME_PER_CASE_S, DEFAULT_MIN_STEPS, DEFAULT_TARGET_CI,
                                 DEFAULT_WARMUP_STEPS, check_choice, parse_batch_size)

DEFAULT_WORKLOAD = "captcha_resnet18"
WORKLOAD_HELP = ("a registered workload with options (see `list`; e.g. deep_mlp:layers=100, timm:resnet18) or "
                 "your own: path/to/file.py:NAME or package.module:NAME; default captcha_resnet18")
# Where a user's own runs go: results/, git-ignored there. The committed reference runs live under
# results/reference/ and are never a default output, so that no command of a user rewrites them.
DEFAULT_OUT = "results"
EXECUTORS = ("local", "ray")
# --case-timeout where cases run isolated and none is given: generous (a case's timing stops after
# --max-time-per-case), so that only a case that never returns reaches it
DEFAULT_ISOLATED_CASE_TIMEOUT_S = 3600.0


@functools.lru_cache(maxsize=1)
def sharded_strategy_names() -> tuple[str, ...]:
    """The names of the strategies of the `strategies` package that run as several ranks of torch.distributed (whose
    class declares `distributed = True` or inherits it), read from their source: the help texts name them, and
    importing a strategy would import torch, which the parser must not."""
    classes: dict[str, tuple[list[str], dict[str, Any]]] = {}  # class name -> (its bases' names, its constants)
    for path in sorted(Path(importlib.util.find_spec("strategies").submodule_search_locations[0]).rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef):
                bases = [base.id if isinstance(base, ast.Name) else base.attr for base in node.bases
                         if isinstance(base, (ast.Name, ast.Attribute))]
                constants = {target.id: statement.value.value for statement in node.body
                             if isinstance(statement, (ast.Assign, ast.AnnAssign))
                             and isinstance(statement.value, ast.Constant)
                             for target in getattr(statement, "targets", [getattr(statement, "target", None)])
                             if isinstance(target, ast.Name)}
                classes[node.name] = (bases, constants)

    def declared(name: str, attribute: str) -> Any:
        bases, constants = classes.get(name, ([], {}))
        if attribute in constants:
            return constants[attribute]
        return next((value for base in bases if base != name and (value := declared(base, attribute)) is not None),
                    None)

    return tuple(sorted(constants["name"] for name, (_, constants) in classes.items()
                        if "name" in constants and declared(name, "distributed")))


def number_type(convert: Callable[[str], Any], valid: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
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


positive_int = number_type(int, lambda v: v > 0, "a positive integer")
positive_float = number_type(float, lambda v: 0 < v < float("inf"), "a positive number of seconds")
fraction = number_type(float, lambda v: 0 < v < 1, "a fraction between 0 and 1 (e.g. 0.05)")  # --target-ci
non_negative_int = number_type(int, lambda v: v >= 0, "0 or a positive integer")
non_negative_float = number_type(float, lambda v: 0 <= v < float("inf"), "0 or a positive number of seconds")
# plan's --headroom and the API's headroom=: 0 keeps nothing free, a meaningful plan
headroom_fraction = number_type(float, lambda v: 0 <= v < 1, "a fraction from 0 up to 1, 1 excluded (e.g. 0.05)")


def csv_list(text: str) -> list[str]:
    """`a, b,,c` -> ['a', 'b', 'c']."""
    return [p.strip() for p in text.split(",") if p.strip()]


def given_text(text: str) -> str:
    """The argparse type of every option that takes free text (`refuse_blank_values`): the text as given, refused
    when it holds nothing but spaces and commas. An empty `--phases ""` or `--strategies " , "` would otherwise be
    read as the option left out, and run its default (every phase, every strategy the planner tries, the default
    workload) without a word."""
    if not text.replace(",", " ").strip():
        raise argparse.ArgumentTypeError(f"empty value {text!r}; give a value, or leave the option out for its "
                                         "default")
    return text


def refuse_blank_values(parser: argparse.ArgumentParser) -> None:
    """Gives every option of `parser` and of its commands that takes free text (an option with no type of its own)
    the type `given_text`, so that an empty value is one line naming the option, wherever the option is declared."""
    for action in parser._actions:  # argparse keeps no public list of a parser's options
        if isinstance(action, argparse._SubParsersAction):
            for command in dict.fromkeys(action.choices.values()):
                refuse_blank_values(command)
        elif action.option_strings and action.type is None and action.nargs != 0:
            action.type = given_text


one_batch_size = parse_batch_size  # the one batch size a command takes (bench.run.preflight, shared with the API)


def add_global_batch_option(p: argparse.ArgumentParser, many: bool = False) -> None:
    """--global-batch-size: the batch of the whole sharded step, where --batch-size is each rank's; with `many`,
    a comma list as --batch-size takes."""
    listed = "one size or a comma list, " if many else ""
    p.add_argument("--global-batch-size", default=None, metavar="N,N..." if many else "N",
                   help=f"with --ranks N: the step's batch over all N ranks, split across them (where N does not "
                        f"divide it the first ranks take one sample more), {listed}in place of --batch-size, which "
                        f"is each rank's (default: --batch-size x N)")


def step_batch_text(args) -> str | None:
    """--batch-size or --global-batch-size as typed (None: neither); a UsageError where both are given."""
    per_rank, whole = getattr(args, "batch_size", None), getattr(args, "global_batch_size", None)
    if per_rank is not None and whole is not None:
        raise UsageError(f"give --batch-size {per_rank} (each rank's) or --global-batch-size {whole} (the step's, "
                         "split across the ranks), not both")
    return whole if whole is not None else per_rank


def batch_option_name(args) -> str:
    """The batch option the user gave, for its error messages."""
    return "--global-batch-size" if getattr(args, "global_batch_size", None) is not None else "--batch-size"


def step_batches(args, sizes: list[int], ranks: int) -> list[int]:
    """The step's global batches of `sizes` (parsed from `step_batch_text`): as given with --global-batch-size,
    else each rank's batch times `ranks`, as torchrun's ranks each load their own batch."""
    if getattr(args, "global_batch_size", None) is not None:
        return sizes
    return [size * ranks for size in sizes]


def batch_option_of(batch_size: int, ranks: int) -> str:
    """The option that asks for the global batch `batch_size` on `ranks` ranks: `--batch-size` a rank where the
    ranks divide it, else `--global-batch-size`."""
    if ranks > 1 and batch_size % ranks:
        return f"--global-batch-size {batch_size}"
    return f"--batch-size {batch_size // max(ranks, 1)}"


def analysis_device(text: str) -> str:
    return check_choice("device", text, ("cpu", "cuda"))


def size_option(text: str, option: str) -> int:
    """A positive size (`4GiB`, `1e9`) given to `option`; a UsageError naming the option otherwise."""
    try:
        return parse_positive_size(text)
    except ValueError as error:
        raise UsageError(f"{option}: bad size {text!r}: {error}") from None


def add_case_options(p: argparse.ArgumentParser) -> None:
    """The options of `run` and `compare`: which cases, how they are timed, where the results go."""
    p.add_argument("--workload", default=None, help=WORKLOAD_HELP)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto: cuda if there is a GPU)")
    p.add_argument("--batch-size", default=None, help="one size or a comma list, e.g. 25,50,100 (default: the "
                                                       "workload's own, 100 for captcha_resnet18; see `list`); "
                                                       "with --ranks N, each rank's")
    add_global_batch_option(p, many=True)
    p.add_argument("--phases", default=None, help="train,eval, train or eval (default train,eval)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="exactly N timed steps per case (default: adaptive timing, see --min-steps; or the suite's)")
    p.add_argument("--warmup", type=non_negative_int, default=None,
                   help=f"warm-up steps before timing (default {DEFAULT_WARMUP_STEPS}, or the suite's)")
    p.add_argument("--min-steps", type=positive_int, default=None,
                   help=f"adaptive timing: time at least N steps, then stop once the median's 95%% confidence "
                        f"interval is within --target-ci or --max-time-per-case is spent (default "
                        f"{DEFAULT_MIN_STEPS}, or the suite's)")
    p.add_argument("--max-time-per-case", type=positive_float, default=None, metavar="SECONDS",
                   help=f"adaptive timing: stop after this many seconds of timed steps, per case and repeat (the "
                        f"step that crosses it finishes; default {DEFAULT_MAX_TIME_PER_CASE_S:g}, or the suite's)")
    p.add_argument("--target-ci", type=fraction, default=None, metavar="FRACTION",
                   help=f"adaptive timing: stop once the 95%% interval of the median is narrower than this "
                        f"fraction of it (default {DEFAULT_TARGET_CI:g}, i.e. about +-2.5%%; or the suite's)")
    p.add_argument("--data", default=None, help="a data source of the workload (see `list`), e.g. captcha (real "
                                                 "images) or synthetic (random tensors); default the workload's first")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"folder for the results CSV (default {DEFAULT_OUT}/)")
    p.add_argument("--quick", action="store_true", help="1 warm-up step and 3 measured steps: a first look in "
                                                        "minutes on a CPU (default off)")
    add_snapshot_option(p, "beside the results CSV, in <run>.snapshots/ (per rank with --ranks)")
    _add_sweep_options(p)


def add_snapshot_option(p: argparse.ArgumentParser, where: str) -> None:
    """--snapshot: a memory snapshot of each case's measured step in PyTorch's format (pytorch.org/memory_viz)."""
    p.add_argument("--snapshot", action="store_true",
                   help="write each case's memory snapshot of its measured step, in the format of "
                        f"torch.cuda.memory._snapshot() (open it at pytorch.org/memory_viz), {where} (default off)")


def add_threads_option(p: argparse.ArgumentParser, recorded: str = "") -> None:
    """--threads, for every command that computes; `recorded` names where the count is written, if anywhere."""
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch.set_num_threads for every case (default: torch's default here, "
                        "usually the physical cores)" + (f"; recorded in {recorded}" if recorded else ""))


def _add_sweep_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="run each case (and each repeat) in a fresh Python process (default: on for cuda, "
                        "off for cpu); --no-isolate runs in this process with process-wide flags restored")
    p.add_argument("--case-timeout", type=non_negative_float, default=None, metavar="SECONDS",
                   help=f"wall-clock limit per case (all its repeats): a case still running then is killed, its row "
                        f"says `timeout` and the sweep goes on; 0 for none. A stuck forward cannot be stopped inside "
                        f"this process, so a limit runs each case isolated (--no-isolate refuses it) (default "
                        f"{DEFAULT_ISOLATED_CASE_TIMEOUT_S:g} where cases run isolated, none where they run in this "
                        f"process)")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="repeat each case's timing and memory passes K times; adds a 95%% CI and a noisy flag "
                        "(default 1)")
    add_threads_option(p, recorded="cpu_threads")
    p.add_argument("--deterministic", action="store_true",
                   help="cudnn.deterministic and torch.use_deterministic_algorithms(True) for each case (default off)")
    p.add_argument("--ranks", type=positive_int, default=1,
                   help="processes of torch.distributed for the sharded strategies "
                        f"{', '.join(sharded_strategy_names())} (gloo on the CPU, NCCL and one GPU each on CUDA), each "
                        "training on its own --batch-size, as torchrun's do (or on its share of --global-batch-size) "
                        "(default 1)")
    p.add_argument("--executor", default=None,
                   help="where the cases run: local (default: this machine, in order) or ray (each case and repeat a "
                        "task in a fresh Ray worker process; see --ray-address)")
    p.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="the Ray cluster for --executor ray (auto, ray://head:10001, head:6379); default: start a "
                        "local Ray bound to 127.0.0.1 for the sweep")
    p.add_argument("--resume", default=None, metavar="CSV",
                   help="continue the run in this results CSV: skip its finished cases, run the rest into it "
                        "(default: a new CSV in --out)")


def add_executor_options(p: argparse.ArgumentParser, what: str, jobs: bool = False) -> None:
    """--executor and --ray-address of plan and fit (`what`: what runs in parallel); with `jobs`, --jobs too."""
    if jobs:
        p.add_argument("--jobs", type=positive_int, default=None,
                       help=f"{what} evaluated at once (default: the cores this process may use, at most 4; with "
                            "--executor ray the cluster's CPUs); 1 evaluates them one after another in this process")
    p.add_argument("--executor", default=None,
                   help=f"where the {what} run: local (default: --jobs worker processes on this machine) or ray "
                        "(each a task in a fresh Ray worker process; see --ray-address)")
    p.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="the Ray cluster for --executor ray (auto, ray://head:10001, head:6379); default: start a "
                        "local Ray bound to 127.0.0.1 for the search")


def add_table_options(p: argparse.ArgumentParser) -> None:
    """Options of the commands that write a table of their own (predict, fit)."""
    p.add_argument("--data", default=None, help="a data source of the workload (default synthetic where it has one)")
    p.add_argument("--workload", default=None, help=WORKLOAD_HELP)
    p.add_argument("--out", default=DEFAULT_OUT, help=f"folder for the CSV (default {DEFAULT_OUT}/)")


def add_memory_limit_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-limit", default=None,
                   help="cap CUDA memory: bytes (2GiB, 512MiB, 1e9) or a fraction of the GPU (0.5); "
                        "on the CPU a warning and no effect (default: no cap)")


def add_seq_len_options(p: argparse.ArgumentParser) -> None:
    """The lengths `--over seq_len` tries (fit and plan)."""
    p.add_argument("--seq-step", type=positive_int, default=256,
                   help="--over seq_len: the answer is a multiple of this many tokens (default 256)")
    p.add_argument("--max-seq-len", type=positive_int, default=None,
                   help="--over seq_len: the longest sequence tried (default: the model's max_position_embeddings)")
