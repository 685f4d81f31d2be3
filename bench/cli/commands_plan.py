"""`plan`: the fastest combination of techniques that fits a memory limit (a --budget or a GPU's memory), from
predictions, with the Pareto front, the CSV of every candidate, the chart, and --confirm's measurements. Its
options are in bench/cli/commands/plan.py, whose run function imports this module when it runs."""

from __future__ import annotations

import dataclasses
import math
import os
import time

from bench.analysis import plan, plan_candidates, plan_cost, plan_floor, plan_ranks, plan_search, plan_step
from bench.analysis.fake_engine import has_gpu
from bench.cli import interrupt
from bench.cli.arguments import analysis_device, batch_option_name, one_batch_size, size_option, step_batch_text
from bench.cli.analysis_console import batch_words, compare_command, mib_or_dash, ms_or_dash
from bench.cli.commands_analysis import batch_size_text, executor_options, uses_threads, workload_and_data
from bench.cli.commands_plan_seq_len import check_over_seq_len, plan_seq_len_command
from bench.cli.commands_plan_ranks import plan_ranks_command
from bench.cli.config_option import derived_job, with_config
from bench.cli.console import status
from bench.core import gpus
from bench.core.errors import UsageError
from bench.core.results import PLAN, Status, new_run_id, table_frame, write_table
from bench.core.units import format_size
from bench.measure import cpu_16bit, env
from bench.measure.op_cost import measure_cpu_speed
from bench.report.pareto_charts import chart_plan
from bench.run.preflight import check_choice, check_output_dir, check_ranks, check_ranks_shard
from strategies import STRATEGIES


def _request(args) -> tuple[plan.PlanRequest, str]:
    """The plan's request from the options, checked before anything runs; and how the limit was made."""
    gpu = gpus.find_gpu(args.gpu) if args.gpu else None
    device = analysis_device(args.device or ("cuda" if gpu else "cpu"))
    check_ranks(args.ranks, None)
    strategies = _candidate_strategies(args)
    if strategies:  # else every strategy the planner tries, the sharded ones among them
        check_ranks_shard(max(args.ranks, args.max_ranks or 1), strategies,
                          "--ranks" if args.max_ranks is None else "--max-ranks")
    if args.max_ranks is not None:
        check_ranks(args.max_ranks, None)
        plan_ranks.check_max_ranks(args.max_ranks)
        if args.ranks > 1:
            raise UsageError(f"give --ranks {args.ranks} (a plan for that many) or --max-ranks {args.max_ranks} (the "
                             "fewest GPUs), not both")
        if args.confirm or args.confirm_front:
            raise UsageError("--max-ranks answers from predictions: measure its answer with the compare command it "
                             "prints (drop --confirm)")
    if gpu and device != "cuda":
        raise UsageError(f"--gpu {args.gpu} plans for CUDA: drop --device {device} (or give --budget for the CPU)")
    if device == "cuda" and gpu is None:
        raise UsageError(f"--device cuda: give --gpu NAME for the device's figures; valid choices: "
                         f"{', '.join(gpus.GPUS)}")
    if args.budget is None and gpu is None:
        raise UsageError("give --budget SIZE (e.g. 500MiB) or --gpu NAME (`plan --list-gpus`)")
    budget = size_option(args.budget, "--budget") if args.budget is not None else gpu.memory_bytes
    if (args.confirm or args.confirm_front) and device == "cuda" and not has_gpu():
        raise UsageError("--confirm measures on the planned device: this machine has no GPU (plan --device cpu "
                         "--budget SIZE confirms on the CPU)")
    workload, data = workload_and_data(args)
    batch = one_batch_size(batch_size_text(args), batch_option_name(args))
    per_rank = batch if args.global_batch_size is None else 0
    limit = gpus.limit_with_headroom(budget, args.headroom)
    context = gpus.CUDA_CONTEXT_BYTES if device == "cuda" else 0
    source = f"--budget {args.budget}" if args.budget is not None else f"the {gpu.name}'s {format_size(budget)}"
    how = f"{source} less {args.headroom:.0%} headroom"
    if gpu is not None:
        figures = plan_cost.gpu_figures(gpu)
        how += f"; CUDA reserved memory + {format_size(context)} CUDA context judged against it"
    else:
        status("plan: timing a matmul, a convolution and a copy on this CPU ...")
        support = cpu_16bit.cpu_16bit_support()
        native = "native" if support.get("bfloat16") else "emulated"
        figures = plan_cost.cpu_figures(measure_cpu_speed(), f"this CPU ({env.cpu_name()}, bfloat16 {native})")
        how += "; exact live tensor bytes judged against it"
    request = plan.PlanRequest(workload, data, batch, device, gpu.name if gpu else "this CPU", limit, context,
                               plan_cost.to_json(figures), 1, gpu.capability if gpu else None,
                               args.allow_different, args.max_candidates, args.max_search_s,
                               args.jobs or plan_search.default_jobs(), strategies=strategies, batch_per_rank=per_rank,
                               gpus_per_node=args.gpus_per_node)
    return request.on_ranks(args.ranks), how


def _candidate_strategies(args) -> list[str]:
    """`--strategies`: names the planner tries (each a registered strategy it does not exclude), checked."""
    if not args.strategies:
        return []
    names = [name.strip() for name in args.strategies.split(",") if name.strip()]
    excluded = plan_candidates.excluded_strategies()
    for name in names:
        STRATEGIES.get(name)  # an unknown name: one line with the valid choices
        if name in excluded:
            raise UsageError(f"--strategies {name}: the planner never tries it ({excluded[name]}); valid choices: "
                             f"{', '.join(n for n in STRATEGIES.names() if n not in excluded and n != 'baseline')}")
    return names


@uses_threads
def cmd_plan(args) -> int:
    """The fastest candidate that fits, the front, the CSV and chart; exit 1 when nothing fits."""
    if args.list_gpus:
        print(gpus.format_gpus())
        return 0
    derived_job(args, "plan")  # --config: plan for the configuration's model and batch
    executor, address = executor_options(args)
    if check_choice("over", args.over, ("batch", "seq_len")) == "seq_len":
        check_over_seq_len(args)
        if step_batch_text(args) is None:
            args.batch_size = "1"
    request, how = _request(args)
    if executor == "ray":
        request = dataclasses.replace(request, jobs=args.jobs or 0)  # 0: the cluster's CPUs
    if args.over == "seq_len":
        return plan_seq_len_command(args, request, how, executor, address)
    if args.max_ranks is not None:
        return plan_ranks_command(args, request, how, executor, address)
    out = check_output_dir(args.out, "--out")
    interrupt.set_note("interrupted: nothing was written (plan writes its table when the search is done)")
    started, cpu_started = time.monotonic(), _cpu_seconds()
    searched, note = plan_search.search_where_cuda_runs(request, status, executor, address)
    rows = with_config(searched.rows, args)
    searched_s, cpu_s = time.monotonic() - started, _cpu_seconds() - cpu_started
    answer = plan.decide(rows, request.allow_different)
    run_id = new_run_id(request.device)
    csv_path, chart_path = out / f"plan-{run_id}.csv", out / f"plan-{run_id}.png"
    if answer is None:
        write_table(PLAN, rows, csv_path)
        print(_nothing_fits(request, searched, csv_path) + (f"\n  note: {note}" if note else ""))
        return 1
    print(_summary(request, how, searched, searched_s, cpu_s, note))
    print(_front_table(rows))
    print(_answer_lines(request, searched, answer))
    if args.confirm or args.confirm_front:
        print(_confirm(request, rows, answer, args.confirm_front, args.threads))
    write_table(PLAN, rows, csv_path)
    chart_plan(table_frame(PLAN, rows), request.limit_bytes, chart_path,
               f"plan: {request.workload}, {batch_words(request.batch_size, request.ranks)}, on {request.target}",
               f"{_predicted_words(rows)}; limit {format_size(request.limit_bytes)} ({how.split(';')[0]})")
    print(f"\nwrote {csv_path} (every candidate) and {chart_path}")
    return 0


def _predicted_words(rows: list) -> str:
    """The chart's words for what it shows: every candidate, or all but those stopped once over the limit."""
    stopped = sum(1 for r in rows if plan_step.stopped_over_limit(r))
    return f"every candidate predicted but {stopped} stopped over the limit" if stopped else "every candidate predicted"


def _cpu_seconds() -> float:
    """CPU time of this process and of the processes it waited for (the fake-CUDA worker)."""
    times = os.times()
    return time.process_time() + times.children_user + times.children_system



def _summary(request: plan.PlanRequest, how: str, searched: plan_search.Searched, searched_s: float, cpu_s: float,
             note: str) -> str:
    rows = searched.rows
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    engines = sorted({r["engine"] for r in rows if r["engine"]})
    estimator = next((r["time_estimator"] for r in rows if r["time_estimator"]), "none")
    lines = [f"plan for {request.workload}, {batch_words(request.batch_size, request.ranks)}, training, on "
             f"{request.target}",
             f"  limit {format_size(request.limit_bytes)} ({request.limit_bytes:,} B): {how}",
             f"  {len(rows)} candidates in {searched_s:.0f} s ({cpu_s:.0f} s of CPU time, {searched.jobs} "
             f"process{'es' if searched.jobs > 1 else ''}; "
             f"{', '.join(f'{n} {s}' for s, n in counts.items())}); memory predicted on the {'/'.join(engines)} "
             f"engine",
             f"  time: {estimator}"]
    stopped = _stopped_early(rows, searched.floor_bytes)
    if stopped:
        lines.append(f"  {stopped}")
    if searched.stopped:
        lines.append(f"  {_cut_short(request, searched)}")
    if note:
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def _stopped_early(rows: list, floor_bytes: int | None = None) -> str:
    """What the summary says of the candidates stopped once they certainly could not fit, and of the combinations
    ruled out by the baseline's parameters and optimizer state (`floor_bytes`) before they ran (none: nothing)."""
    floored = [r["strategy"] for r in rows if plan_floor.stopped_by_floor(r)]
    stopped = [r["strategy"] for r in rows if plan_step.stopped_over_limit(r) and r["strategy"] not in floored]
    said = []
    if stopped:
        said.append(f"{len(stopped)} candidates stopped in their warm-up steps, their reserved memory already over "
                    f"the limit: they do not fit, their peak and time not predicted ({_listed(stopped, 4)}; the CSV "
                    "says how much each had reserved)")
    if floored:
        held = f" ({format_size(floor_bytes)})" if floor_bytes else ""
        alone = sum(1 for r in rows if plan_floor.stopped_by_floor(r) and r["members"] == 1)
        which = f"{len(floored)} combinations" if not alone else (
            f"{len(floored)} candidates ({alone} settings alone, whose combinations cannot fit either)")
        said.append(f"{which} hold the baseline's parameters and optimizer state{held}, over the limit by those "
                    "alone, and were not traced: only a technique that changes them can fit (one that changes what "
                    "is trained, with --allow-different; sharding across GPUs, with --max-ranks)")
    return "\n  ".join(said)


def _front_table(rows: list) -> str:
    front = sorted((r for r in rows if r["on_front"]), key=lambda r: r["est_step_time_ms"])
    header = f"  {'strategy':<44} {'judged MiB':>10} {'est. step ms':>12}  fits"
    lines = ["\nPareto front (candidates that may be the answer: none is both smaller and faster):", header,
             "  " + "-" * (len(header) - 2)]
    for r in front:
        mark = "  <- answer" if r["answer"] else ""
        lines.append(f"  {r['strategy']:<44} {mib_or_dash(r['judged_bytes']):>10} "
                     f"{ms_or_dash(r['est_step_time_ms']):>12}  "
                     f"{'yes' if r['fits'] else 'no'}{mark}")
    stopped = [r for r in rows if plan_step.stopped_over_limit(r)]
    if stopped:
        lines.append(f"  ({len(stopped)} candidates stopped once over the limit are not on it: their peak and time "
                     "were not predicted)")
    different = [r for r in rows if r["status"] == Status.OK and r["differs_by_design"] and not r["eligible"]
                 and not plan_step.stopped_over_limit(r)]
    if different:
        lines.append(f"  ({len(different)} candidates that change what is trained kept out: "
                     f"{', '.join(r['strategy'] for r in different[:4])}{', ...' if len(different) > 4 else ''}; "
                     "--allow-different lets them in)")
    return "\n".join(lines)


def _answer_lines(request: plan.PlanRequest, searched: plan_search.Searched, answer) -> str:
    rows = searched.rows
    base = next((r for r in rows if r["strategy"] == "baseline"), None)
    relative = ""
    if base is not None and base["est_step_time_ms"]:
        relative = (f" ({answer['est_step_time_ms'] / base['est_step_time_ms']:.2f}x the baseline's estimate; "
                    f"baseline {mib_or_dash(base['judged_bytes'])} MiB)")
    lines = [f"\nanswer: {answer['strategy']}: {mib_or_dash(answer['judged_bytes'])} MiB predicted of "
             f"{mib_or_dash(request.limit_bytes)} MiB, estimated {ms_or_dash(answer['est_step_time_ms'])} ms per "
             f"step{relative}"]
    if plan.host_note(answer):
        lines.append(plan.host_note(answer))
    if searched.stopped:
        lines.append(f"  (the fastest of the {searched.tried} candidates tried: {searched.untried()} not tried may be "
                     f"faster; {_option_for_more(request, searched)} tries them)")
    front = sorted((r for r in rows if r["on_front"] and r["members"]), key=lambda r: r["est_step_time_ms"])
    explained = [(r["strategy"], plan.contributions(r, rows)) for r in front]
    if any(parts for _, parts in explained):
        lines.append("what each technique on the front contributes (against the candidate without it):")
        for spec, parts in explained:
            if len(parts) == 1 and "+" not in spec:
                lines.append(f"  {spec}: {parts[0].removeprefix(spec).strip()} against the baseline")
            elif parts:
                lines.append(f"  {spec}: {'; '.join(parts)}")
    lines.append(f"measure it: {compare_command(request, answer['strategy'])}")
    return "\n".join(lines)




def _nothing_fits(request: plan.PlanRequest, searched: plan_search.Searched, csv_path) -> str:
    """One line when the search tried every candidate; else what it tried, and what it did not with the option
    that tries it (no conclusion that needs the candidates not tried)."""
    smallest = plan.smallest(searched.rows)
    limit = f"{format_size(request.limit_bytes)} ({request.limit_bytes:,} B)"
    stopped = _stopped_early(searched.rows, searched.floor_bytes)
    if searched.stopped:
        found = ("none could be predicted" if smallest is None else
                 f"the smallest of them {format_size(smallest['judged_bytes'])} with {smallest['strategy']}")
        return (f"no candidate tried fits {limit}, but the search was cut short ({found}; every candidate tried: "
                f"{csv_path})\n  {_cut_short(request, searched)}")
    if smallest is None:
        return (f"no candidate fits {format_size(request.limit_bytes)}: none could be predicted (see {csv_path})"
                + (f"\n  {stopped}" if stopped else ""))
    if stopped:  # a candidate stopped early may be smaller than the smallest predicted: no "reachable" claim
        return (f"no candidate fits {limit}: the smallest of those predicted to the end is "
                f"{format_size(smallest['judged_bytes'])} ({smallest['judged_bytes']:,} B) with {smallest['strategy']}"
                f" (every candidate: {csv_path})\n  {stopped}")
    return (f"no candidate fits {limit}: the smallest reachable is {format_size(smallest['judged_bytes'])} "
            f"({smallest['judged_bytes']:,} B) with {smallest['strategy']} (every candidate: {csv_path})")


def _listed(specs: list[str], most: int = 6) -> str:
    return ", ".join(specs[:most]) + (f" and {len(specs) - most} more" if len(specs) > most else "")


def _option_for_more(request: plan.PlanRequest, searched: plan_search.Searched) -> str:
    """The option that lets the search try what it did not: more time, or more candidates."""
    if searched.stopped == plan_search.COUNT:
        return f"--max-candidates {request.max_candidates + searched.untried()} (or more)"
    per = searched.seconds_per_candidate or 1.0
    more = request.max_search_s + searched.untried() * per
    return f"--max-search-s {math.ceil(more / 10) * 10:g} (about {per:.1f} s a candidate here)"


def _cut_short(request: plan.PlanRequest, searched: plan_search.Searched) -> str:
    """What a search cut short did not try, and the option that tries it."""
    limit = (f"--max-search-s {request.max_search_s:g}" if searched.stopped == plan_search.TIME
             else f"--max-candidates {request.max_candidates}")
    parts = []
    if searched.untried_settings:
        parts.append(f"{len(searched.untried_settings)} settings alone ({_listed(searched.untried_settings)}) and "
                     "their combinations")
    if searched.untried_combinations:
        parts.append(f"{len(searched.untried_combinations)} combinations "
                     f"({_listed(searched.untried_combinations, 4)})")
    return (f"the search stopped at {limit} before trying {' and '.join(parts)}: {_option_for_more(request, searched)}"
            " tries them")


def _confirm(request: plan.PlanRequest, rows: list, answer, front: bool, threads: int | None) -> str:
    """Measures the answer (and with `front` every front candidate); an answer measured over the limit is
    reported and the next fastest fitting candidate confirmed in its place."""
    environment = env.environment(request.device)
    lines = [f"\nconfirmed with the harness on {request.device} ({plan.CONFIRM_WARMUP_STEPS} warm-up, "
             f"{plan.CONFIRM_STEPS} timed steps):"]
    fitting = sorted((r for r in rows if r["eligible"] and r["fits"]), key=lambda r: r["est_step_time_ms"])
    targets = [r for r in rows if r["on_front"]] if front else []
    for row in fitting[fitting.index(answer):]:
        status(f"plan: confirming {row['strategy']} ...")
        judged = plan.measured_judged_bytes(request, row, plan.confirm(request, row, environment, threads))
        if judged is not None and judged <= request.limit_bytes:
            lines.append(f"  answer {row['strategy']}: measured {mib_or_dash(judged)} MiB <= limit "
                         f"{mib_or_dash(request.limit_bytes)} MiB")
            if row is not answer:
                answer["answer"], row["answer"] = False, True
            break
        lines.append(f"  {row['strategy']}: measured {mib_or_dash(judged)} MiB, over the limit (or did not run): "
                     "the next "
                     f"fastest candidate that fits is confirmed")
    for row in targets:
        if row["measured_peak_bytes"] is None:
            status(f"plan: confirming {row['strategy']} ...")
            plan.confirm(request, row, environment, threads)
    measured = [r for r in rows if r["measured_peak_bytes"] is not None]
    header = (f"  {'strategy':<44} {'predicted MiB':>13} {'measured MiB':>12} {'error %':>8} {'est. ms':>9} "
              f"{'measured ms':>11}  matches")
    lines += [header, "  " + "-" * (len(header) - 2)]
    for r in measured:
        error = "-" if r["peak_error_pct"] is None else f"{r['peak_error_pct']:.2f}"
        lines.append(f"  {r['strategy']:<44} {mib_or_dash(r['predicted_peak_bytes']):>13} "
                     f"{mib_or_dash(r['measured_peak_bytes']):>12} {error:>8} {ms_or_dash(r['est_step_time_ms']):>9} "
                     f"{ms_or_dash(r['measured_step_time_ms']):>11}  {r['matches_baseline']}")
    timed = [r for r in measured if r["measured_step_time_ms"] is not None]
    rho = plan.spearman([r["est_step_time_ms"] for r in timed], [r["measured_step_time_ms"] for r in timed])
    worst = max((abs(r["peak_error_pct"]) for r in measured if r["peak_error_pct"] is not None), default=None)
    if worst is not None:
        lines.append(f"  largest peak error {worst:.2f}%"
                     + (f"; Spearman rank correlation of estimated and measured times {rho:.2f} over {len(timed)}"
                        if rho is not None else ""))
    return "\n".join(lines)

