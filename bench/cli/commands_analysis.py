"""What `explain`, `predict` and `fit` do: analyse a case's memory rather than time a sweep. Their names, help lines
and options are in bench/cli/commands/, whose run functions import this module when they run."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections import Counter
from dataclasses import replace
from typing import Callable, Iterator

from bench.analysis import explain as analysis
from bench.analysis import fit as fitting
from bench.analysis import layer_replay, predict, predict_assumptions, proof_beside
from bench.cli import interrupt
from bench.cli.analysis_console import (format_explain, format_fit, format_fit_seq_len, format_plan_units,
                                        format_predictions, nothing_fits, rank_share)
from bench.cli.arguments import (DEFAULT_WORKLOAD, EXECUTORS, analysis_device, batch_option_name,
                                 csv_list, one_batch_size, size_option, step_batch_text, step_batches)
from bench.cli.commands_run import apply_memory_limit
from bench.cli.config_option import derived_job, with_config
from bench.cli.console import status
from bench.core import gpus
from bench.core.errors import Unsupported, UsageError
from bench.core.results import FIT, PREDICT, Status, new_run_id, write_table
from bench.core.snapshots import snapshot_folder, writable_snapshot_folder
from bench.core.units import format_size
from bench.measure import env, fake_cuda, snapshot
from bench.run import preflight
from bench.run.isolation import process_state
from bench.run.preflight import check_choice, check_output_dir, parse_batch_sizes
from bench.run.rule_of_thumb import rule_of_thumb
from bench.run.case import Case, bind_case
from bench.run.runner import CaseMeter
from strategies import parse_strategy
from strategies.framework.sharding import data_parallel_replicas
from workloads import get_workload

PHASES = ("train", "eval")


@contextlib.contextmanager
def _worker_threads(threads: int | None) -> Iterator[None]:
    """OMP_NUM_THREADS for the processes a command starts (predict's fake-CUDA worker), restored on exit."""
    before = os.environ.get("OMP_NUM_THREADS")
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before


def uses_threads(command: Callable[..., int]) -> Callable[..., int]:
    """Runs `command(args)` with --threads applied (torch.set_num_threads here and in the processes it starts),
    checked first against the cores available; every process-wide flag is restored afterwards."""
    @functools.wraps(command)
    def with_threads(args) -> int:
        preflight.check_threads(args.threads)
        with process_state(threads=args.threads), _worker_threads(args.threads):
            return command(args)

    return with_threads


def workload_and_data(args) -> tuple[str, str]:
    """The workload's canonical spec and the data source (default: synthetic where the workload has it, since
    memory does not depend on the values, else its first)."""
    workload = get_workload(args.workload or DEFAULT_WORKLOAD)
    default = "synthetic" if "synthetic" in workload.data_sources else workload.data_sources[0]
    return workload.spec(), workload.check_data(args.data or default)


def batch_size_text(args) -> str:
    """--batch-size (or --global-batch-size) as given, else the workload's own default batch (as `run` and `compare`
    take it)."""
    return step_batch_text(args) or str(get_workload(args.workload or DEFAULT_WORKLOAD).default_batch_size)


def _planned_case(args) -> tuple[Case, object]:
    """`explain`'s case and its bound strategy, checked and planned; a UsageError where it cannot run here."""
    workload, data = workload_and_data(args)
    phase = check_choice("phase", args.phase, PHASES)
    device = check_choice("device", args.device, ("cpu",))  # the breakdown needs the exact CPU tracker
    batch = one_batch_size(batch_size_text(args))
    strategy, context = bind_case(Case(workload, args.strategy, phase, batch, device, data=data))
    try:
        strategy.check(context)
    except Unsupported as error:
        raise UsageError(f"{strategy.spec()} cannot run here: {error}") from None
    case = Case(workload, strategy.spec(), phase, batch, device, data=data)
    try:
        strategy.plan(CaseMeter(case))
    except Unsupported as error:
        raise UsageError(f"{strategy.spec()} cannot run here: {error}") from None
    return case, strategy


@uses_threads
def cmd_explain(args) -> int:
    """The peak of one case broken down (params, grads, optimizer, activations, temporaries, batch), the rule
    of thumb beside it, and memory added by each module's forward."""
    case, strategy = _planned_case(args)
    out = check_output_dir(args.out, "--out") if args.snapshot else None
    result = analysis.explain(case, strategy, record_snapshot=args.snapshot)
    print(format_explain(case, result["memory"], result["modules"],
                         rule_of_thumb(case.workload, case.phase, case.batch_size)))
    if out is not None:
        about = {"workload": case.workload, "strategy": case.strategy, "phase": case.phase,
                 "batch_size": case.batch_size, "data": case.data, "device": case.device, "kind": "measured",
                 "peak_mem_bytes": result["memory"]["peak_mem_bytes"], "rank": None}
        folder = snapshot_folder(out / f"explain-{new_run_id(case.device)}.csv")
        path = snapshot.write_snapshot(snapshot.tracker_snapshot(result["tracker"], about), folder)
        print(f"\nmemory snapshot: {path} (open it at https://pytorch.org/memory_viz)")
    plan = analysis.checkpoint_plan_of(strategy)
    if plan is not None and case.phase == "train":
        baseline = fitting.measured_peak(replace(case, strategy="baseline"),
                                         bind_case(replace(case, strategy="baseline"))[0])
        label, groups, kind = plan
        print(format_plan_units(label, kind, analysis.plan_units(case, groups), result["memory"]["peak_mem_bytes"],
                                baseline))
    return 0


def _stand_by_beside(args, device: str) -> None:
    """Layer replay's worker stood by for predictions made in this process on CUDA (`proof_beside.stand_by`), before
    reading the workload asks torch about CUDA, after which no worker could use it."""
    if device == "cuda" and layer_replay.might_replay(args.workload or DEFAULT_WORKLOAD):
        proof_beside.stand_by(args.workload)


@uses_threads
def cmd_predict(args) -> int:
    """Predicted torch.cuda.max_memory_allocated per case, without a GPU (assumptions printed); writes a CSV."""
    job = derived_job(args, "predict")  # --config: the case of the user's trainer configuration
    _stand_by_beside(args, args.device or "cuda")
    workload, data = workload_and_data(args)
    gpu, device = _gpu_and_device(args, "cuda")
    engine = check_choice("engine", args.engine, predict.ENGINES)
    compute_capability = gpus.capability_for(args.capability, device, gpu)
    preflight.check_ranks(args.ranks, None)
    phases = [check_choice("phase", p, PHASES) for p in csv_list(args.phases or "train,eval")]
    specs = predict.predicted_specs(csv_list(args.strategies or ""))
    if job is not None:  # the configuration's case alone: its baseline would be another job
        specs = [job.strategy]
    strategies = [parse_strategy(spec) for spec in specs]  # unknown names: exit 2 before any work
    batches = step_batches(args, parse_batch_sizes(batch_size_text(args), batch_option_name(args)), args.ranks)
    preflight.check_ranks_shard(args.ranks, strategies)
    out = check_output_dir(args.out, "--out")
    interrupt.set_note("interrupted: nothing was written (predict writes its table at the end)")
    cases = [Case(workload, spec, phase, batch, device, data=data) for spec in specs for phase in phases
             for batch in batches]

    def progress(index: int, case: Case) -> None:
        status(predict.progress_line(index, len(cases), case))

    path = out / f"predict-{new_run_id(device)}.csv"
    snapshots = writable_snapshot_folder(path) if args.snapshot else None
    rows = predict.predict_cases(cases, engine, args.ranks, compute_capability, on_case=progress,
                                 snapshot_dir=None if snapshots is None else str(snapshots))
    with_config(rows, args)  # the configuration the case was derived from, beside the spec it ran
    print(f"predicted peak memory on {device}" + (" (torch.cuda.max_memory_allocated and max_memory_reserved)"
                                                  if device == "cuda" else " (exact live tensor bytes)"))
    if args.ranks > 1:
        print(_batch_split(specs, strategies, batches, args.ranks))
    print(format_predictions(rows))
    if device == "cuda":
        print("\nassumptions:")
        for line in predict_assumptions.assumptions(row["engine"] for row in rows):
            print(f"  - {line}")
    if gpu is not None:
        print(_fits_on(gpu, rows))
    write_table(PREDICT, rows, path)
    print(f"\nwrote {path}")
    if snapshots is not None and snapshots.exists():
        print(f"memory snapshots in {snapshots} (open one at https://pytorch.org/memory_viz)")
    if not any(row["status"] == Status.OK for row in rows):  # as `run`: a table of refusals only is a failed command
        counts = Counter(row["status"] for row in rows)
        print(f"error: no case was predicted ({', '.join(f'{n} {s}' for s, n in counts.items()) or 'no rows'}); "
              f"the message column of {path} says why", file=sys.stderr)
        return 1
    return 0


def _batch_split(specs: list[str], strategies: list, batches: list[int], ranks: int) -> str:
    """How the step's batch is split: over the ranks, or where tensor- or context-parallel groups share their
    samples, over the data-parallel replicas (a line for each replica count among the strategies)."""
    by_replicas: dict[int, list[str]] = {}
    for spec, strategy in zip(specs, strategies):
        by_replicas.setdefault(data_parallel_replicas(strategy, ranks), []).append(spec)
    lines = []
    for replicas, named in sorted(by_replicas.items(), reverse=True):
        over = (f"over {ranks} ranks" if replicas == ranks else
                f"over the {replicas} data-parallel replica{'s' if replicas > 1 else ''} of {ranks} ranks (each "
                f"group of {ranks // replicas} shares its samples)")
        whose = "" if len(by_replicas) == 1 else f" with {', '.join(named)}"
        lines.append(f"batch: the step's, {over}{whose} ("
                     + "; ".join(f"{batch}: {rank_share(batch, replicas)}" for batch in batches) + ")")
    return "\n".join(lines)


def _gpu_and_device(args, default_device: str) -> tuple[object, str]:
    """(the --gpu's figures or None, the device): --gpu implies CUDA, as `plan` takes it."""
    gpu = gpus.find_gpu(args.gpu) if args.gpu else None
    device = analysis_device(args.device or ("cuda" if gpu else default_device))
    if gpu is not None and device != "cuda":
        raise UsageError(f"--gpu {args.gpu} is a CUDA device: drop --device {device}")
    return gpu, device


def executor_options(args) -> tuple[str, str | None]:
    """(--executor, --ray-address) of plan and fit, checked before anything runs as compare checks them: one line
    for a bad executor, an address without ray, a malformed address or one where nothing answers."""
    executor = check_choice("executor", args.executor or "local", EXECUTORS)
    if executor != "ray":
        if args.ray_address:
            raise UsageError("--ray-address needs --executor ray")
        return executor, None
    from bench.run.ray_executor import checked_address

    return executor, checked_address(args.ray_address)


def _fit_jobs(args, executor: str) -> int:
    """--jobs of fit: given, else the cores this process may use (at most 4) locally, the cluster's CPUs on Ray."""
    from bench.analysis import pools

    return args.jobs or (0 if executor == "ray" else pools.default_jobs())


def _fit_budget(args, gpu) -> int:
    """--budget, else the --gpu's memory; a UsageError when neither is given."""
    if args.budget is not None:
        return size_option(args.budget, "--budget")
    if gpu is None:
        raise UsageError("give --budget SIZE (e.g. 4GiB) or --gpu NAME (`plan --list-gpus`)")
    return gpu.memory_bytes


@uses_threads
def cmd_fit(args) -> int:
    """The largest batch size under a memory budget, per strategy (baseline always), each verified by a run; or
    with --over seq_len the longest sequence at a batch, on predictions."""
    over = check_choice("over", args.over, ("batch", "seq_len"))
    job = derived_job(args, "fit")  # --config: the configuration's model and strategy; fit searches the batch
    if job is not None and over == "batch":
        args.batch_size = None
    gpu, device = _gpu_and_device(args, "cpu")
    if over == "batch" and device == "cuda" and args.executor == "ray":
        raise UsageError("--executor ray: fit --device cuda makes its batch attempts one after another (on one GPU "
                         "they would disturb each other's peaks); valid: --device cpu, or --over seq_len")
    executor, address = executor_options(args)
    budget = _fit_budget(args, gpu)
    if over == "seq_len" and _fit_jobs(args, executor) == 1:
        _stand_by_beside(args, device)  # its probes predicted here (a pool's workers have their cores)
    workload, data = workload_and_data(args)
    if over == "seq_len":
        return _fit_over_seq_len(args, gpu, device, budget, workload, data, executor, address)
    if args.batch_size is not None:
        raise UsageError("--batch-size is the batch of --over seq_len; --over batch searches the batch (see "
                         "--max-batch)")
    if device == "cuda" and fake_cuda.environment_python() is None:  # with it, fit predicts on fake CUDA
        env.resolve_device("cuda")
    phase = check_choice("phase", args.phase, PHASES)
    max_batch = one_batch_size(args.max_batch, "--max-batch")
    specs = csv_list(args.strategies or "")
    for spec in specs:
        parse_strategy(spec)
    preflight.check_steps(args.time_steps, "--time-steps", 0)
    memory = preflight.machine_memory_bytes()
    if device == "cpu" and memory is not None and budget > memory:
        # fit confirms each answer with a real run: a budget beyond the machine's memory cannot be confirmed
        raise UsageError(f"--budget {args.budget} is more than this machine's {format_size(memory)} of memory; "
                         "on the CPU each answer is confirmed by a real run, so give a budget below that (or "
                         "`predict` for larger batches)")
    out = check_output_dir(args.out, "--out")
    apply_memory_limit(args.memory_limit, device)
    interrupt.set_note("interrupted: nothing was written (fit writes its table when every strategy is done)")
    results = fitting.fit(specs, budget, phase, device, workload, data, max_batch, args.time_steps,
                          progress=status, capability=gpu.capability if gpu else None,
                          jobs=_fit_jobs(args, executor), executor=executor, ray_address=address)
    failure = nothing_fits(results)
    if failure is not None:
        print(failure)
        return 1
    print(f"largest batch with peak <= {format_size(budget)} ({budget:,} B) on {gpu.name if gpu else device}, "
          f"phase {phase}")
    print(format_fit(results, args.time_steps))
    path = out / f"fit-{new_run_id(device)}.csv"
    write_table(FIT, with_config(fitting.fit_rows(results), args), path)
    print(f"\nwrote {path}")
    return 0


def _fit_over_seq_len(args, gpu, device: str, budget: int, workload: str, data: str, executor: str,
                      address: str | None) -> int:
    """`fit --over seq_len`: the longest sequence per strategy at --batch-size, on predictions (no run)."""
    from bench.analysis import fit_seq_len

    phase = check_choice("phase", args.phase, PHASES)
    batch = one_batch_size(args.batch_size or "1")
    specs = csv_list(args.strategies or "")
    for spec in specs:
        parse_strategy(spec)
    out = check_output_dir(args.out, "--out")
    interrupt.set_note("interrupted: nothing was written (fit writes its table when every strategy is done)")
    results = fit_seq_len.fit_over_seq_len(specs, budget, phase, device, workload, data, batch, args.seq_step,
                                           args.max_seq_len, gpu.capability if gpu else None, progress=status,
                                           jobs=_fit_jobs(args, executor), executor=executor, ray_address=address)
    where = f"{gpu.name} ({format_size(budget)})" if gpu else f"{device}, budget {format_size(budget)}"
    print(f"longest sequence (a multiple of {args.seq_step} tokens) at batch {batch} on {where}, phase {phase}; "
          "predicted, not run")
    print(format_fit_seq_len(results))
    path = out / f"fit-{new_run_id(device)}.csv"
    write_table(FIT, with_config(fitting.fit_rows(results), args), path)
    print(f"\nwrote {path}")
    if not any(r.seq_len for r in results):
        print(f"error: no strategy fits even {args.seq_step} tokens; the note column of {path} says why",
              file=sys.stderr)
        return 1
    return 0


def _fits_on(gpu, rows) -> str:
    """predict --gpu: whether each predicted case fits the GPU's memory, judged as `plan` judges (reserved + the
    CUDA context); a case that fits only within the headroom `plan` keeps free by default is said to."""
    headroom_limit = gpus.limit_with_headroom(gpu.memory_bytes)
    lines = [f"\non the {gpu.name} ({format_size(gpu.memory_bytes)}; judged: reserved + "
             f"{format_size(gpus.CUDA_CONTEXT_BYTES)} CUDA context):"]
    for row in rows:
        if row["predicted_reserved_bytes"] is None:
            continue
        judged = row["predicted_reserved_bytes"] + gpus.CUDA_CONTEXT_BYTES
        verdict = ("does not fit" if judged > gpu.memory_bytes else "fits" if judged <= headroom_limit else
                   f"fits, but in the last {gpus.DEFAULT_HEADROOM:.0%} of the card, which plan keeps free by default "
                   f"(--headroom: fragmentation the allocator model misses, other libraries' buffers)")
        lines.append(f"  {row['strategy']} {row['phase']} bs={row['batch_size']}: {format_size(judged)} {verdict}")
    return "\n".join(lines)
