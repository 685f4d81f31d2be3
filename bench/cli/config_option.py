"""`--config FILE [KEY=VALUE ...]` of predict, fit and plan: the case derived from a trainer's configuration file
(bench.jobs), the options given beside it winning, printed as the spec it runs with every key's fate."""

from __future__ import annotations

import argparse

from bench.core.errors import UsageError

CONFIG_HELP = ("your trainer's configuration, read as the case to predict: a Hugging Face Trainer/TRL SFTConfig file "
               "(YAML or JSON, with lora: and quantization: sections), a torchtune recipe YAML, an axolotl YAML, a "
               "torchtitan job TOML or accelerate's FSDP config YAML (its model from --workload), then overrides as "
               "`tune run` takes them (key=value, section.key=value, ~key); options given beside it (--workload for "
               "the model, --batch-size, --ranks, --phases) override the file (default: none)")


def add_config_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", nargs="+", default=None, metavar=("FILE", "KEY=VALUE"), help=CONFIG_HELP)


def with_config(rows: list[dict], args) -> list[dict]:
    """`rows` with the configuration they were derived from in their `config` column (--config), as written."""
    for row in rows:
        row["config"] = getattr(args, "config_text", None)
    return rows


def derived_job(args, command: str):
    """The DerivedJob of --config (None without it), the options given beside it applied, and the lines that say
    so printed with the derived case; `args` gains the derived workload, strategy, batch and phases."""
    if not getattr(args, "config", None):
        return None
    from bench.jobs import derive_job

    path, *overrides = args.config
    ranks = getattr(args, "ranks", 1)
    job = derive_job(path, overrides, ranks=ranks if ranks > 1 else None, workload=args.workload)
    explicit_batch = getattr(args, "batch_size", None)
    if getattr(args, "global_batch_size", None) is not None:
        raise UsageError("--global-batch-size with --config: give --batch-size (each device's batch) or none")
    batch = None
    if explicit_batch is not None:
        try:
            batch = int(explicit_batch)
        except ValueError:
            raise UsageError(f"--batch-size {explicit_batch!r} with --config: one batch size") from None
    # accelerate's and a DeepSpeed JSON's configurations name no model: --workload is their model, not an override
    own_model = job.kind not in ("accelerate", "deepspeed")
    job, notes = job.with_explicit(workload=args.workload if own_model else None, batch_size=batch,
                                   ranks=ranks if ranks > 1 else None)
    if getattr(args, "strategies", None) and command != "plan":
        raise UsageError("--strategies with --config: the configuration gives the strategy; change it in the file "
                         "or with an override (key=value)")
    print(job.describe())
    for note in notes:
        print(f"  {note}")
    print()
    if job.unsupported:  # the accounting above, then the one line: the job needs a strategy membench lacks
        raise UsageError(job.unsupported)
    if job.ranks and hasattr(args, "ranks") and args.ranks == 1:
        args.ranks = job.ranks  # the configuration's processes, where --ranks does not say otherwise
    args.config_text = job.config_text  # recorded in the rows (with_config)
    args.workload = job.workload
    args.batch_size = str(job.batch_size)
    if job.global_batch_size is not None and hasattr(args, "global_batch_size"):
        args.batch_size, args.global_batch_size = None, str(job.global_batch_size)  # TP/CP groups share samples
    if command != "plan":
        args.strategies = job.strategy
    if command == "predict" and getattr(args, "phases", None) is None:
        args.phases = ",".join(job.phases)
    return job
