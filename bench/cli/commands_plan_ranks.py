"""`plan --max-ranks N`: the fewest GPUs on which some plan fits, the plan, and what each GPU count reached."""

from __future__ import annotations

import time

from bench.analysis import plan, plan_ranks
from bench.cli import interrupt
from bench.cli.analysis_console import compare_command, mib_or_dash, ms_or_dash
from bench.cli.arguments import sharded_strategy_names
from bench.cli.config_option import with_config
from bench.cli.console import status
from bench.core.results import PLAN, new_run_id, write_table
from bench.core.units import format_size
from bench.run.preflight import check_output_dir



def plan_ranks_command(args, request: plan.PlanRequest, how: str, executor: str = "local",
                       address: str | None = None) -> int:
    """Each rank count's search from one up, the answer (the fewest ranks and its plan), the CSV of every candidate;
    exit 1 when no rank count up to --max-ranks has a plan that fits."""
    plan_ranks.check_max_ranks(args.max_ranks)  # before the output folder is made
    out = check_output_dir(args.out, "--out")
    started = time.monotonic()
    csv_path = out / f"plan-{new_run_id(request.device)}.csv"

    def write_so_far(counts: list, last: plan_ranks.RankCount) -> None:
        """The CSV rewritten (atomically) after each rank count: an interrupted search keeps the counts it finished.
        The first count's write makes the run's file (never over another run's); the later ones rewrite it."""
        write_table(PLAN, with_config([row for count in counts for row in count.searched.rows], args), csv_path,
                    new=len(counts) == 1)
        status(f"plan on {last.ranks} rank{'s' if last.ranks > 1 else ''}: {last.searched.tried} candidates, "
               + (f"answer {last.answer['strategy']}" if last.answer else "none fits")
               + (f", the smallest {mib_or_dash(last.smallest['judged_bytes'])} MiB with {last.smallest['strategy']}"
                  if last.smallest else "") + f" (written to {csv_path})")

    interrupt.set_file_note(csv_path, f"interrupted: {csv_path} holds the rank counts that finished",
                            "interrupted: no rank count was finished, nothing was written")
    counts = plan_ranks.fewest_ranks(request, args.max_ranks, status, executor, address, write_so_far)
    print(_per_rank_count(request, how, counts, time.monotonic() - started, args.max_ranks))
    answered = plan_ranks.fewest(counts)
    print(_answer(request, answered, counts))
    print(f"\nwrote {csv_path} (every candidate of every rank count; column ranks)")
    return 0 if answered else 1


def _per_rank_count(request: plan.PlanRequest, how: str, counts: list, seconds: float, max_ranks: int) -> str:
    batch = (f"batch {request.batch_per_rank} a rank" if request.batch_per_rank else
             f"global batch {request.batch_size}, split across the ranks")
    lines = [f"how many GPUs: {request.workload}, {batch}, training, on {request.target}",
             f"  limit per GPU {format_size(request.limit_bytes)} ({request.limit_bytes:,} B): {how}",
             f"  {sum(c.searched.tried for c in counts)} candidates in {seconds:.0f} s; at 2 ranks and more only "
             f"those with a sharded member ({', '.join(sharded_strategy_names())}), each rank predicted in one process",
             "",
             f"  {'ranks':>5} {'tried':>5}  {'smallest per GPU':<48} {'the front (judged MiB / est. ms)'}",
             "  " + "-" * 110]
    for count in counts:
        smallest = count.smallest
        small = "-" if smallest is None else f"{mib_or_dash(smallest['judged_bytes'])} MiB {smallest['strategy']}"
        front = sorted((r for r in count.searched.rows if r["on_front"]), key=lambda r: r["est_step_time_ms"])
        shown = ", ".join(f"{r['strategy']} {mib_or_dash(r['judged_bytes'])}/{ms_or_dash(r['est_step_time_ms'])}"
                          + (" <- answer" if r["answer"] else "") for r in front[:3])
        more = f" and {len(front) - 3} more" if len(front) > 3 else ""
        cut = "; cut short" if count.searched.stopped else ""
        lines.append(f"  {count.ranks:>5} {count.searched.tried:>5}  {small:<48} {shown or '-'}{more}{cut}")
        if count.note:
            lines.append(f"        note: {count.note}")
    passed = plan_ranks.skipped(counts, max_ranks, request)
    if passed:
        lines.append(f"  not tried: {', '.join(map(str, passed))} rank(s): the counts are searched (doubling, then "
                     f"halving the gap below the first with an answer down to {plan_ranks.SCANNED_GAP} counts, all "
                     "tried), assuming a plan's per-GPU memory never grows with the ranks; "
                     f"{plan_ranks.monotonic_check(counts)}")
    if request.most_ranks(max_ranks) < max_ranks:
        lines.append(f"  ranks beyond {request.batch_size} not tried: --global-batch-size {request.batch_size} is "
                     "split across the ranks, at least one sample each (a larger one, or --batch-size a rank, tries "
                     "more)")
    return "\n".join(lines)


def _front_on(count: plan_ranks.RankCount) -> str:
    """The answer's rank count's Pareto front, memory per GPU against the estimated step time (of which its
    collectives: `comm ms`), each candidate with its mesh (none is both smaller and faster than another)."""
    front = sorted((r for r in count.searched.rows if r["on_front"]), key=lambda r: r["est_step_time_ms"])
    lines = [f"  the front on {count.ranks} GPU{'s' if count.ranks > 1 else ''} (memory per GPU against estimated "
             "step time):",
             f"    {'mesh':<18} {'strategy':<48} {'judged MiB':>10} {'est. ms':>10} {'comm ms':>9}  fits"]
    for r in front:
        lines.append(f"    {plan_ranks.mesh_of(r['strategy'], count.ranks):<18} {r['strategy']:<48} "
                     f"{mib_or_dash(r['judged_bytes']):>10} {ms_or_dash(r['est_step_time_ms']):>10} "
                     f"{ms_or_dash(r['est_comm_time_ms']):>9}  "
                     f"{'yes' if r['fits'] else 'no'}" + ("  <- answer" if r["answer"] else ""))
    return "\n".join(lines)


def _answer(request: plan.PlanRequest, answered, counts: list) -> str:
    if answered is None:
        last = counts[-1] if counts else None  # the most ranks tried
        cut = any(c.searched.stopped for c in counts)
        found = ("" if last is None or last.smallest is None else
                 f"; the smallest on {last.ranks}: {format_size(last.smallest['judged_bytes'])} with "
                 f"{last.smallest['strategy']}")
        return (f"\nno plan tried fits {format_size(request.limit_bytes)} per GPU on up to "
                f"{counts[-1].ranks if counts else 0} GPUs{found}"
                + ("\n  (some searches were cut short: --max-search-s or --max-candidates tries more)" if cut else ""))
    row = answered.answer
    gpus = f"{answered.ranks} GPU{'s' if answered.ranks > 1 else ''}"
    mesh = f" as {plan_ranks.mesh_of(row['strategy'], answered.ranks)}" if answered.ranks > 1 else ""
    lines = [f"\nanswer: {gpus}{mesh}, with {row['strategy']}: {mib_or_dash(row['judged_bytes'])} MiB predicted per "
             f"GPU of {mib_or_dash(request.limit_bytes)} MiB, estimated {ms_or_dash(row['est_step_time_ms'])} ms per "
             "step" + (f" (the largest rank's compute plus {ms_or_dash(row['est_comm_time_ms'])} ms of "
                       "collectives, not overlapped)" if answered.ranks > 1 else "")]
    if plan.host_note(row):
        lines.append(plan.host_note(row))
    lines.append(_front_on(answered))
    if answered.searched.stopped:
        lines.append("  (its search was cut short: a faster plan on as many GPUs may exist)")
    fewer = [c.ranks for c in counts if c.ranks < answered.ranks and c.searched.stopped]
    if fewer:
        lines.append(f"  (the searches on {', '.join(map(str, fewer))} rank(s) were cut short before trying every "
                     "candidate: fewer GPUs may do; --max-search-s or --max-candidates tries more)")
    lines.append(f"measure it: {compare_command(request.on_ranks(answered.ranks), row['strategy'])}")
    return "\n".join(lines)
