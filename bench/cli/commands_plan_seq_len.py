"""`plan --over seq_len`: the combination of techniques that trains the longest sequence within the limit, from
predictions, with every candidate's longest (or the probe that ruled it out) and the fit table's CSV."""

from __future__ import annotations

from bench.analysis import fit, fit_seq_len, plan, plan_seq_len
from bench.cli import interrupt
from bench.cli.analysis_console import format_fit_seq_len
from bench.cli.commands_analysis import workload_and_data
from bench.cli.config_option import with_config
from bench.cli.console import status
from bench.core.errors import UsageError
from bench.core.results import FIT, new_run_id, write_table
from bench.core.units import format_size
from bench.run.preflight import check_output_dir


def check_over_seq_len(args) -> None:
    """What `--over seq_len` does not combine with, refused before anything runs."""
    if args.max_ranks is not None or args.ranks > 1:
        raise UsageError("--over seq_len plans for one GPU: drop --ranks/--max-ranks (or plan --over batch on "
                         "several ranks)")
    if args.confirm or args.confirm_front:
        raise UsageError("--over seq_len answers from predictions: measure its answer with the compare command it "
                         "prints (drop --confirm)")
    fit_seq_len.longest_tried(workload_and_data(args)[0], args.seq_step, args.max_seq_len)  # before any work


def plan_seq_len_command(args, request: plan.PlanRequest, how: str, executor: str = "local",
                         address: str | None = None) -> int:
    """The search (`bench.analysis.plan_seq_len`), its table and answer, the CSV; exit 1 when nothing fits."""
    out = check_output_dir(args.out, "--out")
    interrupt.set_note("interrupted: nothing was written (plan --over seq_len writes its table when done)")
    found = plan_seq_len.longest_plan(request, args.seq_step, args.max_seq_len, status, request.jobs, executor,
                                      address)
    path = out / f"fit-{new_run_id(request.device)}.csv"
    write_table(FIT, with_config(fit.fit_rows(found.results), args), path)
    print(f"longest sequence (a multiple of {args.seq_step} tokens) at batch {request.batch_size} on "
          f"{request.target}, training; predicted, not run")
    print(f"  limit {format_size(request.limit_bytes)} ({request.limit_bytes:,} B): {how}")
    print(f"  {len(found.results)} candidates in {found.seconds:.0f} s: the baseline, each setting alone, then "
          "combinations of those that reached further than the baseline; a candidate over the limit one step past "
          "the longest found so far is not searched further")
    print()
    print(format_fit_seq_len(found.results))
    if found.differs:
        print(f"  ({len(found.differs)} candidates that change what is trained kept out: "
              f"{', '.join(sorted(found.differs))}; --allow-different lets them in)")
    if found.stopped:
        limit = (f"--max-search-s {request.max_search_s:g}" if found.stopped == "time"
                 else f"--max-candidates {request.max_candidates}")
        print(f"  the search stopped at {limit} before trying {len(found.untried)} candidates "
              f"({', '.join(found.untried[:6])}{' ...' if len(found.untried) > 6 else ''}): a larger {limit.split()[0]} "
              "tries them")
    print(_answer(request, found, args))
    print(f"\nwrote {path} (every candidate, the fit table with over = seq_len)")
    return 0 if found.answer is not None else 1


def _answer(request: plan.PlanRequest, found: plan_seq_len.SeqLenSearch, args) -> str:
    answer = found.answer
    if answer is None:
        return (f"\nno candidate tried fits even {found.results[0].seq_len_step} tokens within "
                f"{format_size(request.limit_bytes)}" + ("; the search was cut short" if found.stopped else ""))
    cut = "; the search was cut short: a candidate not tried may reach further" if found.stopped else ""
    gpu = f" --gpu \"{request.target}\"" if request.device == "cuda" else ""
    workload = fit_seq_len.seq_len_spec(request.workload, answer.seq_len)
    target = f"--gpu \"{args.gpu}\"" if args.gpu else f"--budget {args.budget} --device {request.device}"
    tied = (f"\n  {len(found.tied)} other candidates reach {answer.seq_len:,} tokens too ({', '.join(found.tied[:4])}"
            f"{' ...' if len(found.tied) > 4 else ''}): chosen by fewer techniques, then the smaller peak; the fastest "
            f"of them: python -m bench plan --workload {workload} --batch-size {request.batch_size} {target} "
            f"--strategies {','.join(sorted({m.split(':')[0] for s in [answer.strategy, *found.tied] for m in s.split('+')}))}"
            if found.tied else "")
    return (f"\nanswer: {answer.strategy}: {answer.seq_len:,} tokens at batch {request.batch_size}, judged "
            f"{format_size(answer.judged_bytes)} of {format_size(request.limit_bytes)}; "
            f"{answer.seq_len + answer.seq_len_step:,} tokens: "
            + ("-" if answer.next_judged_bytes is None else format_size(answer.next_judged_bytes)) + cut + tied
            + f"\ncheck it: python -m bench predict --workload {workload} --batch-size {request.batch_size} "
              f"--device {request.device}{gpu} --strategies {answer.strategy}")
