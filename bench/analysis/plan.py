"""Plan: the fastest combination of techniques whose training step fits a memory limit, from predictions, and the
measurements that confirm it.

Each candidate (`bench.analysis.plan_candidates`) runs one tracked step on fake tensors, as `predict` does
(`bench.analysis.fake_engine.tracked_step`, CUDA's caching allocator replayed for CUDA), with an operator counter
(`bench.measure.op_cost`) in the same step: one trace gives both its peak and its operators, whose time is
estimated against the device's figures (`bench.analysis.plan_cost`). The search (`bench.analysis.plan_search`) tries
every declared setting alone and combinations of the settings that helped, by what can still be the answer. Each
candidate is a row of the declared plan table (`bench.core.results.PLAN`). The operators are counted in the measured
step only, and a candidate whose figures the search does not need once it cannot fit (a combination; on several
ranks, any) stops as soon as its CUDA step, or one of its ranks' steps, certainly cannot (`bench.analysis.plan_step`).
A full-size model whose layers `predict` replays is traced at a few layers instead (`bench.analysis.layer_replay`):
its event log built from them, its operator totals extrapolated from theirs, each proven on one more trace
(`bench.analysis.plan_replay`); one that may stop runs its full-size step up to its first backward first, or
through its first warm-up step where the rest of that step costs less than the replay.

A sharded strategy's step runs rank by rank in this process (PyTorch's fake process group); its time estimate is that
of the rank with the largest peak: its compute, and its collectives over the links their groups cross, added
without overlap (`bench.analysis.plan_cost`). Times are estimates for ranking: the confirmation measures.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace

import torch
from torch._subclasses import fake_tensor

from bench.analysis import plan_cost, plan_replay, plan_step
from bench.analysis.fake_engine import PredictionMeter, bound_device, cublas_workspace, tracked_step
from bench.core.errors import Unsupported
from bench.core.gpus import DEFAULT_MAX_CANDIDATES, DEFAULT_MAX_SEARCH_S
from bench.core.results import PLAN, Status
from bench.core.schema import Row
from bench.core.units import format_size
from bench.measure import cuda_allocator
from bench.measure.op_cost import OperatorCostCounter, step_totals
from bench.run.isolation import RunOptions
from bench.run.case import Case, bind_case
from bench.run.runner import MEMORY_WARMUP_STEPS, forget_traceback, run_case

# what fake tensors cannot run but a real step can (an output whose shape depends on the values): the fallback to a
# real CPU step is for these only
FAKE_TENSOR_LIMITS = tuple(getattr(fake_tensor, name) for name in (
    "DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException",
    "UnsupportedFakeTensorException") if hasattr(fake_tensor, name))
# estimates this close to the fastest count as equally fast: the answer is then the one with fewer techniques
SAME_TIME_RATIO = 1.005


@dataclass
class PlanRequest:
    """What to plan: the case, the device and its figures, the limit; JSON-able (the fake-CUDA worker reads it)."""

    workload: str
    data: str
    batch_size: int
    device: str  # cpu or cuda
    target: str  # a GPU's name, `cuda` (a --budget on CUDA) or `this CPU`
    limit_bytes: int  # what judged_bytes must not exceed
    context_bytes: int  # the CUDA context added to reserved memory (0 on the CPU)
    figures: dict  # plan_cost.to_json of the device's figures
    ranks: int = 1
    capability: tuple[int, int] | None = None
    allow_different: bool = False
    max_candidates: int = DEFAULT_MAX_CANDIDATES
    max_search_s: float = DEFAULT_MAX_SEARCH_S  # no candidate starts after this many seconds of search
    jobs: int = 1  # processes evaluating candidates at once (`bench.analysis.plan_search`)
    # `plan --max-ranks` at 2 ranks or more: only candidates with a sharded member run, the others' rows (which
    # --ranks does not change) come from the plan on one GPU, in `known_rows`
    sharded_only: bool = False
    known_rows: list = field(default_factory=list)
    strategies: list = field(default_factory=list)  # the strategies whose settings are candidates (empty: every one)
    # `plan --max-ranks`: each rank's batch, so that on N ranks the step's batch is N times it; 0: batch_size is the
    # step's batch on every rank count (--global-batch-size), split across the ranks
    batch_per_rank: int = 0
    gpus_per_node: int = 8  # `--gpus-per-node`: a tensor-parallel group of the meshes tried stays inside a node
    feeds_ranks: bool = False  # the one-rank search of `plan --max-ranks`: its settings' ratios make sharded candidates

    def case(self, spec: str) -> Case:
        return Case(self.workload, spec, "train", self.batch_size, self.device, data=self.data)

    def on_ranks(self, ranks: int) -> PlanRequest:
        """This request on `ranks` ranks: with a batch per rank, the step's batch grows with them."""
        batch = self.batch_per_rank * ranks if self.batch_per_rank else self.batch_size
        return replace(self, ranks=ranks, batch_size=batch)

    def most_ranks(self, max_ranks: int) -> int:
        """The most ranks up to `max_ranks` this request can run on: a fixed global batch gives each rank at least
        one sample."""
        return max_ranks if self.batch_per_rank else min(max_ranks, self.batch_size)


def empty_row(request: PlanRequest, spec: str, members: int) -> Row:
    row = PLAN.row({name: None for name in PLAN.names if name != "schema_version"})
    row.update(workload=request.workload, batch_size=request.batch_size, ranks=request.ranks, device=request.device,
               target=request.target, strategy=spec, members=members, status=Status.OK.value, message="",
               limit_bytes=request.limit_bytes, fits=False, eligible=False, on_front=False, answer=False)
    return row


def bind_for_plan(case: Case, ranks: int):
    """(strategy, context) of `case`, bound as predict binds it (to CUDA on a machine without it)."""
    with warnings.catch_warnings():  # a strategy bound to CUDA on a machine without it (as predict does)
        warnings.filterwarnings("ignore", message=".*GradScaler is enabled, but CUDA is not available.*")
        return bind_case(case, ranks)


def _stopped_row(row: Row, stopped: plan_step.OverLimit, request: PlanRequest, notes: list[str]) -> Row:
    """A candidate's row stopped over the limit: no peak, no time, why; then `notes` (why layer replay was refused)."""
    judged = stopped.reserved_bytes + request.context_bytes
    why = (f"{plan_step.STOPPED_OVER_LIMIT}: {stopped.when} of warm-up step {stopped.step} the caching allocator had "
           f"reserved {format_size(stopped.reserved_bytes)}; with the CUDA context that is {judged:,} B, over the "
           f"limit ({request.limit_bytes:,} B), and reserved memory never shrinks: its peak and time were not "
           "predicted")
    row.update(fits=False, message="; ".join([why, *notes]))
    return row


def _engines(device: str, distributed: bool) -> list[str]:
    engines = (["fake-cuda"] if device == "cuda" and torch.cuda.is_available() else []) + ["fake", "cpu"]
    return [e for e in engines if e != "fake"] if distributed else engines


def evaluate(request: PlanRequest, spec: str, members: int, figures: plan_cost.DeviceFigures,
             may_stop: bool = False, probe: bool = True) -> Row:
    """One candidate's row: its predicted peak (and on CUDA reserved memory), its step's operators and estimated
    time, and what it changes in training; `unsupported` or `error` with why.

    `may_stop`: the caller needs no figure of a candidate that cannot fit, but for a single setting whose memory and
    time ratios may make combinations (one that keeps what is trained, or any with `allow_different`; on several
    ranks, any). Such a candidate's CUDA step stops in its warm-up steps once the caching allocator's model has
    reserved more than the limit allows (`plan_step.ReservedCheck`; a sharded step, once one of its ranks has): its
    row says so, with no peak and no time (`plan_step.stopped_over_limit`). Where layer replay applies
    (`plan_replay.replayed_candidate`), such a candidate's full-size step is looked at only up to its first
    backward, or through its first warm-up step where the rest of that step costs less than the replay
    (`plan_replay.probes_first_step`): one that got there is replayed, with every figure. With `probe` False it is
    replayed at once: the search's combinations whose members' ratios promise that they fit, whose look at the
    forward (a third of what their replay costs) was passed and thrown away; one that does not fit after all gets
    every figure."""
    row = empty_row(request, spec, members)
    case = request.case(spec)
    cuda = request.device == "cuda"
    try:
        strategy, context = bind_for_plan(case, request.ranks)
        row["strategy"] = strategy.spec()
        strategy.check(context)
    except Unsupported as error:
        row.update(status=Status.UNSUPPORTED.value, message=str(error))
        return row
    engines, notes = _engines(request.device, strategy.distributed), []
    # the counter counts the measured step only where the warm-up steps are known (CUDA's: passed to tracked_step)
    warmup = MEMORY_WARMUP_STEPS["cuda"] if cuda else None
    # on several ranks every candidate is sharded (`PlanRequest.sharded_only`), and a sharded setting alone that
    # cannot fit still combines (`plan_search`), so the search needs no figure of any candidate that cannot fit
    stop = may_stop and cuda and (members >= 2 or request.sharded_only
                                  or (not request.allow_different and bool(strategy.differs_by_design())))

    def reserved_check(probe: bool | None = None) -> plan_step.ReservedCheck | None:
        if not stop:
            return None
        if probe is None:
            return plan_step.ReservedCheck(request.limit_bytes, request.context_bytes, request.capability)
        return plan_replay.FullSizeProbe(request.limit_bytes, request.context_bytes, request.capability, probe)

    for engine in engines:
        def trace(engine: str, planned, probe: bool | None = None):
            """(the candidate's step traced at full size on `engine`, the operator counter of its measured step);
            `probe` (`plan_replay.FullSizeProbe`): where given, the check gives up at the first warm-up step's
            backward, or where True at its end."""
            counter = plan_step.MeasuredStepCounter() if warmup else OperatorCostCounter()
            rank_counters: dict[int, OperatorCostCounter] = {}

            def rank_strategy(rank: int, device: str = bound_device(engine)):
                """A rank's own strategy, its operators counted apart (the largest rank's step is timed), stopped as
                a whole candidate is once its own step certainly cannot fit: the row's judged memory is its largest
                rank's."""
                rank_counters[rank] = plan_step.MeasuredStepCounter() if warmup else OperatorCostCounter()
                ranked = bind_for_plan(replace(case, device=device), request.ranks)[0]
                ranked.plan(PredictionMeter(case))
                return plan_step.counted(ranked, rank_counters[rank], warmup, reserved_check(probe))

            step = tracked_step(case, spec, engine, 1, cuda_autocast=cuda, ranks=request.ranks, record_events=cuda,
                                warmup_steps=warmup, capability=request.capability,
                                planned=plan_step.counted(planned, counter, warmup, reserved_check(probe)),
                                rank_strategy=rank_strategy if strategy.distributed else None)
            return step, rank_counters.get(step.rank, counter)

        def planned_on(engine: str):
            """The candidate's strategy bound to `engine`'s device and planned, as predict binds it."""
            planned = bind_for_plan(replace(case, device=bound_device(engine)), request.ranks)[0]
            planned.plan(PredictionMeter(case))
            return planned

        try:
            planned = planned_on(engine)
            if stop and probe and plan_replay.replay_applies(case, spec, engine, planned, request, warmup):
                # a candidate that may stop: its full-size step first, up to its first backward or through its
                # first step (`plan_replay.probes_first_step`); one over the limit there stops (its weights alone:
                # before its first module, in a fraction of what its replay costs), one that got past is replayed
                try:
                    step, counter = trace(engine, planned, plan_replay.probes_first_step(case, planned, warmup))
                    break  # no backward was looked at: the step ran to its end, its figures the full trace's
                except plan_replay.ProbePassed:
                    planned = planned_on(engine)
            replayed = plan_replay.replayed_candidate(case, spec, engine, planned, request, figures, warmup, notes)
            if replayed is not None:
                row["engine"] = engine
                _memory(row, replayed[0], request)
                row["differs_by_design"] = planned.differs_by_design()
                row.update(replayed[1])
                if strategy.distributed:
                    notes.append(_largest_rank_note(replayed[0].rank, request.ranks))
                row["message"] = "; ".join(notes)
                return row
            step, counter = trace(engine, planned)
            break
        except plan_step.OverLimit as stopped:
            row.update(engine=engine, differs_by_design=planned.differs_by_design())
            return _stopped_row(row, stopped, request, notes)
        except Unsupported as error:
            row.update(status=Status.UNSUPPORTED.value, message=str(error))
            return row
        except Exception as error:  # noqa: BLE001 - an engine may not run a strategy: the next one is the fallback
            forget_traceback(error)
            next_engine = engines[engines.index(engine) + 1] if engine != engines[-1] else None
            if next_engine is None or (next_engine == "cpu" and not isinstance(error, FAKE_TENSOR_LIMITS)):
                # a failure that is not the fake tensors' own would fail a real step too, which costs seconds
                row.update(status=Status.ERROR.value, message=f"{type(error).__name__}: {error}".splitlines()[0][:300])
                return row
            notes.append(f"{engine} engine failed ({type(error).__name__}): ran on the "
                         f"{engines[engines.index(engine) + 1]}")
    row["engine"] = engine
    _memory(row, step, request)
    row["differs_by_design"] = planned.differs_by_design()
    if warmup and len(counter.steps) != warmup + 1:  # the counter was armed for another step than the measured one
        row.update(status=Status.ERROR.value, message=f"{len(counter.steps)} steps ran where the operator counter "
                   f"expected {warmup} warm-up steps and the measured one: no time estimate")
        return row
    ops = counter.steps[-1] if counter.steps else []
    if ops:
        totals = step_totals(ops)
        row.update(step_flops=totals["flops"], step_moved_bytes=totals["bytes"],
                   host_transfer_bytes=totals["transfer_bytes"], step_collective_bytes=totals["collective_bytes"],
                   step_ops=totals["ops"])
        try:
            communication_s = figures.communication_seconds(ops, request.gpus_per_node)
            row["est_step_time_ms"] = (figures.compute_seconds(ops) + communication_s) * 1e3
            row["est_comm_time_ms"] = communication_s * 1e3
            row["time_estimator"] = f"{plan_cost.ESTIMATOR}; {figures.name}: {figures.source}"
        except Unsupported as error:
            row.update(status=Status.UNSUPPORTED.value)
            notes.append(str(error))
    else:
        notes.append("no time estimate: no operator of its step was counted")
    if strategy.distributed:
        notes.append(_largest_rank_note(step.rank, request.ranks))
    row["message"] = "; ".join(notes)
    return row


def _largest_rank_note(rank: int, ranks: int) -> str:
    """What a sharded candidate's row says of its time."""
    return (f"time: rank {rank}'s (the largest of {ranks}), its compute plus its collectives, not overlapped (an "
            "upper bound)")


def _memory(row: Row, step, request: PlanRequest) -> None:
    """The row's memory figures from the tracked step (on CUDA through the caching allocator's model)."""
    if request.device != "cuda":
        row.update(predicted_peak_bytes=step.peak_bytes, judged_bytes=step.peak_bytes)
    else:
        replayed = cuda_allocator.replay(step.events, cublas_workspace(request.capability))
        row.update(predicted_peak_bytes=replayed.max_allocated_bytes,
                   predicted_reserved_bytes=replayed.max_reserved_bytes,
                   judged_bytes=replayed.max_reserved_bytes + request.context_bytes)
    row["fits"] = row["judged_bytes"] <= request.limit_bytes
    row["offload_host_peak_bytes"] = getattr(step, "offload_host_peak_bytes", None) or None


def host_note(row: Row) -> str:
    """What an offloading candidate asks of each rank's host, which the limit does not judge ('' for the others)."""
    host = row["offload_host_peak_bytes"]
    return (f"  (its offloaded copies hold {format_size(host)} of host memory a rank at most, which the limit does "
            "not judge)") if host else ""


# --- the answer -----------------------------------------------------------------------------------------------

def pareto(rows: list[Row]) -> list[Row]:
    """The eligible rows that no other eligible row beats on both judged memory and estimated time, by time."""
    front, best = [], math.inf
    for row in sorted((r for r in rows if r["eligible"]), key=lambda r: (r["est_step_time_ms"], r["judged_bytes"])):
        if row["judged_bytes"] < best:
            front.append(row)
            best = row["judged_bytes"]
    return front


def decide(rows: list[Row], allow_different: bool) -> Row | None:
    """Marks each row eligible, on the front, the answer; returns the answer (None: nothing eligible fits): the
    fastest eligible candidate that fits, where one within 0.5% of its estimate with fewer techniques wins."""
    for row in rows:
        row["eligible"] = bool(row["status"] == Status.OK.value and row["est_step_time_ms"] is not None
                               and row["judged_bytes"] is not None
                               and (allow_different or not row["differs_by_design"]))
        row["on_front"] = row["answer"] = False
    for row in pareto(rows):
        row["on_front"] = True
    fitting = [r for r in rows if r["eligible"] and r["fits"]]
    if not fitting:
        return None
    fastest = min(r["est_step_time_ms"] for r in fitting)
    answer = min((r for r in fitting if r["est_step_time_ms"] <= fastest * SAME_TIME_RATIO),
                 key=lambda r: (r["members"], r["est_step_time_ms"], r["judged_bytes"]))
    answer["answer"] = True
    return answer


def smallest(rows: list[Row]) -> Row | None:
    """The eligible row with the smallest judged memory (what no fit reports)."""
    return min((r for r in rows if r["eligible"]), key=lambda r: r["judged_bytes"], default=None)


def contributions(row: Row, rows: list[Row]) -> list[str]:
    """What each member of `row` contributes: `row` against the candidate without it (memory, time), where that
    one was predicted."""
    by_spec = {r["strategy"]: r for r in rows if r["status"] == Status.OK.value}
    members = row["strategy"].split("+") if row["members"] else []
    found = []
    for member in members:
        rest = "+".join(m for m in members if m != member) or "baseline"
        other = by_spec.get(rest)
        if other is None or other["est_step_time_ms"] is None or row["est_step_time_ms"] is None:
            continue
        memory = other["judged_bytes"] - row["judged_bytes"]
        speed = row["est_step_time_ms"] / other["est_step_time_ms"] - 1
        saved = "same memory" if memory == 0 else f"{'-' if memory > 0 else '+'}{format_size(abs(memory))}"
        found.append(f"{member} {saved} {'+' if speed >= 0 else '-'}{abs(speed) * 100:.0f}% time")
    return found


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None for fewer than 3 pairs or a constant list."""
    if len(xs) < 3:
        return None

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        result = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                result[order[k]] = (i + j) / 2
            i = j + 1
        return result

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx, sy = math.sqrt(sum((a - mx) ** 2 for a in rx)), math.sqrt(sum((b - my) ** 2 for b in ry))
    return None if sx == 0 or sy == 0 else cov / (sx * sy)


# --- confirmation by the harness --------------------------------------------------------------------------------

CONFIRM_WARMUP_STEPS, CONFIRM_STEPS = 1, 3  # the --quick figures: a confirmation is a check, not a benchmark


def confirm(request: PlanRequest, row: Row, env: dict | None = None, threads: int | None = None) -> Row:
    """Measures `row`'s candidate with the harness on the planned device (`bench.run.runner.measure_case`: verified
    against the baseline, timed, its peak measured) and fills the row's measured columns; returns the harness's
    row (its status says when it could not run)."""
    case = replace(request.case(row["strategy"]), warmup=CONFIRM_WARMUP_STEPS, steps=CONFIRM_STEPS)
    measured = run_case(case, env, RunOptions(threads=threads, ranks=request.ranks).resolved())
    if measured["status"] == Status.OK.value:
        peak = int(measured["peak_mem_bytes"])
        row.update(measured_peak_bytes=peak, measured_step_time_ms=measured["step_time_ms_median"],
                   matches_baseline=measured["matches_baseline"])
        if row["predicted_peak_bytes"]:
            row["peak_error_pct"] = (row["predicted_peak_bytes"] - peak) / peak * 100
    else:
        row["message"] = "; ".join(x for x in (row["message"], f"confirmation: {measured['status']}: "
                                               f"{measured['message']}") if x)
    return measured


def measured_judged_bytes(request: PlanRequest, row: Row, measured: Row) -> int | None:
    """What the limit is compared with, as measured: the peak on the CPU; reserved memory plus the CUDA context on
    CUDA."""
    if measured["status"] != Status.OK.value:
        return None
    if request.device == "cuda":
        return int(measured["peak_reserved_bytes"]) + request.context_bytes
    return int(measured["peak_mem_bytes"])
