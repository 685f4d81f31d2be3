"""The plan's search: which candidates run, in which order, in how many processes, and what a search cut short did
not try (`bench.analysis.plan` evaluates one candidate and decides the answer).

The search runs the baseline and every declared setting alone (`plan_candidates.settings`), and pairs and triples
of the settings that saved memory or time alone (`plan_candidates.combinations`; a triple once its pairs ran, never
when one of them failed). Its order is by what can still be the answer: each time a process is free it starts,
first, the combinations whose members' ratios promise to fit and to be faster than any candidate that ran and
fits (fastest promise first); then the settings not yet tried that are their strategy's first declared one; then
the other combinations (those that promise to fit, then the others by smallest promise); then the other settings
(a strategy's second and third ones: checkpoint's sqrt(N) and budget plans, the optimizer's other
implementations). A setting that cannot fit cannot help a combination fit unless it saves memory, and what it
saves is known only once it ran: a combination of two settings that did is not held up behind the settings still
untried.

The same candidates run in the same order with `jobs` processes as with one, but for which of the ones that may
start at a moment finishes first; with no limit reached the rows are the same (a test). Candidates run in worker
processes forked from this one (its imports and caches inherited: the workload's batch, its checkpoint units, its
BatchNorm lookup), each with one thread: fake tensors do no arithmetic. With `executor="ray"` each candidate is a
Ray task instead, in a fresh worker process (`bench.run.ray_executor.RayPool`), as many at once as the cluster has
CPUs; the order and the stopping rules are the same, and so are the rows (a test in tests/test_ray.py).

A search cut short by `max_search_s` or `max_candidates` says which candidates it knew of and did not try
(`Searched.untried`), and the settings not tried alone, whose combinations it cannot know.
"""

from __future__ import annotations

import concurrent.futures as futures
import itertools
import math
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from bench.analysis import plan, plan_candidates, plan_floor, plan_step, plan_tasks, pools
from bench.analysis.fake_cuda_worker import run_in_fake_cuda
from bench.core.results import PLAN, Status
from bench.core.schema import Row
from bench.measure import fake_cuda
from bench.run import eta
from strategies import STRATEGIES, PlanSpace

# a combination is tried when each of its members, alone, saved memory (1%) or time (0.5%) against the baseline: a
# saving of time alone (a faster optimizer implementation) still combines with one of memory
USEFUL_MEMORY_RATIO, USEFUL_TIME_RATIO = 0.99, 0.995
TIME, COUNT = "time", "count"  # why a search stopped early


@dataclass
class Searched:
    """The rows of the candidates that ran (the baseline first) and of the settings the case refuses; and, for a
    search cut short (`stopped`: "time" or "count"), the candidates it knew of and did not try: settings not tried
    alone (whose combinations it cannot know) and combinations of settings that ran."""

    rows: list[Row]
    stopped: str | None = None
    untried_settings: list[str] = field(default_factory=list)
    untried_combinations: list[str] = field(default_factory=list)
    seconds_per_candidate: float | None = None  # wall-clock seconds per candidate that ran, with `jobs` processes
    jobs: int = 1
    tried: int = 0  # candidates that ran (the refused settings are rows too, but ran nothing)
    floor_bytes: int | None = None  # the baseline's parameters and optimizer state (`plan_floor`), where counted

    def untried(self) -> int:
        return len(self.untried_settings) + len(self.untried_combinations)

    def to_json(self) -> dict:
        return {**asdict(self), "rows": [dict(r) for r in self.rows]}

    @classmethod
    def from_json(cls, values: dict) -> "Searched":
        return cls(**{**values, "rows": [PLAN.row(r) for r in values["rows"]]})


def _ratio(row: Row | None, base: Row, column: str) -> float:
    if row is not None and _sharded_and_stopped(row):
        return 1.0  # no figure (it cannot fit alone): promises neither a saving nor a cost
    if row is None or row["status"] != Status.OK.value or row[column] is None or not base[column]:
        return math.inf
    return row[column] / base[column]


def _sharded_and_stopped(row: Row) -> bool:
    """A sharded setting alone stopped once it could not fit (on several ranks every candidate may stop): what it
    saves is unknown, and sharding exists to combine with what saves the rest."""
    return plan_step.stopped_over_limit(row) and row["members"] == 1 \
        and any(STRATEGIES.get(member.split(":")[0]).distributed for member in row["strategy"].split("+"))


def _declaration_rank(settings: list) -> dict[str, int]:
    """Each setting's rank within its strategy's declaration (0: the strategy's first)."""
    seen: dict[str, int] = {}
    ranks = {}
    for setting in settings:
        ranks[setting.spec] = seen.get(setting.strategy, 0)
        seen[setting.strategy] = ranks[setting.spec] + 1
    return ranks


# --- running candidates in forked worker processes (`bench.analysis.plan_tasks`: how each runs) ---------------

def _executor(jobs: int, workload: str):
    """The forked workers of a local search (`bench.analysis.pools.local`)."""
    return pools.local(jobs, __name__, workload)


# --- the search ---------------------------------------------------------------------------------------------------

class _Queue:
    """What the search knows: the rows so far, the settings, and the candidates that may start now, by priority."""

    def __init__(self, request: plan.PlanRequest, accepted: list, context, floor: int | None = None,
                 alone_too: bool = False):
        self.request = request
        self.accepted = accepted
        self.rank = _declaration_rank(accepted)
        self.context = context
        self.rows: dict[str, Row | None] = {}  # spec -> row (None while it runs), in the order they started
        # rows another search found, which this one does not run again (`PlanRequest.known_rows`)
        self.known = {row["strategy"]: PLAN.row(row) for row in request.known_rows}
        self.rows.update(self.known)
        self.combined: dict[frozenset, tuple[tuple, str | None]] = {}  # member specs -> (members, spec or None)
        self.floored: set[str] = set()  # the candidates the floor ruled out (`plan_floor`): no trace, not counted
        # the floor's rows, by spec (None: traced), worked out once: the progress lines count what is left to trace
        self.floor, self.alone_too, self._floor_rows = floor, alone_too, {}

    def base(self) -> Row | None:
        return self.rows.get("baseline")

    def _useful(self) -> list:
        base = self.base()
        if base is None or base["status"] != Status.OK.value or not base["judged_bytes"]:
            return []
        found = []
        for setting in self.accepted:
            row = self.rows.get(setting.spec)
            if self._unknown_member(setting):
                found.append(setting)
            elif row is not None and row["status"] == Status.OK.value \
                    and (self.request.allow_different or not row["differs_by_design"]) \
                    and (_sharded_and_stopped(row) or _ratio(row, base, "judged_bytes") < USEFUL_MEMORY_RATIO
                         or _ratio(row, base, "est_step_time_ms") < USEFUL_TIME_RATIO):
                found.append(setting)
        return found

    def _unknown_member(self, setting) -> bool:
        """A setting that shards nothing, its strategy's first declared one, in a search of sharded candidates, that
        the one-rank search did not get to (cut short): it cannot run alone here, and what it saves is unknown, so
        it combines with neutral ratios (`_ratio` of no row) rather than not at all. A strategy's later settings
        wait for the one-rank search that tries them (--max-search-s): each would multiply the candidates."""
        return self.request.sharded_only and bool(self.known) and setting.spec not in self.rows \
            and self.rank[setting.spec] == 0 and not STRATEGIES.get(setting.strategy).distributed

    def _member_ratio(self, setting, column: str) -> float:
        return 1.0 if self._unknown_member(setting) else _ratio(self.rows[setting.spec], self.base(), column)

    def _combination(self, members: tuple) -> str | None:
        key = frozenset(m.spec for m in members)
        if key not in self.combined:
            self.combined[key] = (members, plan_candidates.compose(members, self.context))
        return self.combined[key][1]

    def combinations(self) -> list[tuple[tuple, str]]:
        """Every composable pair and triple of useful settings whose smaller combinations did not fail."""
        useful = self._useful()
        found = []
        for size in (2, 3):
            for members in _combinations_of(useful, size):
                spec = self._combination(members)
                if spec is not None and (size == 2 or not self._a_pair_failed(members)):
                    found.append((members, spec))
        return found

    def _a_pair_failed(self, members: tuple) -> bool:
        for pair in _combinations_of(list(members), 2):
            spec = self._combination(pair)
            row = self.rows.get(spec) if spec is not None else None
            if spec is None or (row is not None and row["status"] != Status.OK.value):
                return True
        return False

    def _pairs_ran(self, members: tuple) -> bool:
        return all(self.rows.get(self._combination(pair)) is not None for pair in _combinations_of(list(members), 2))

    def next(self) -> tuple[str, int, bool] | None:
        """The candidate to start now (spec, members, whether its members' ratios promise that it fits), or None
        when none may start yet (or at all)."""
        if "baseline" not in self.rows:
            return "baseline", 0, False
        base, ready = self.base(), []
        for setting in self.accepted:
            if setting.spec not in self.rows and self._may_run((setting,)):
                # on several ranks every sharded setting alone is an early one: it stops once it cannot fit, and
                # the combinations need it (fsdp's offload, its mixed precision policy)
                first = self.rank[setting.spec] == 0 or self.request.sharded_only
                ready.append(((1 if first else 3, self.rank[setting.spec], 0.0), setting.spec, 1, False))
        if base is not None and base["status"] == Status.OK.value and base["judged_bytes"]:
            fastest = self._fastest_fitting()
            for members, spec in self.combinations():
                if spec in self.rows or (len(members) > 2 and not self._pairs_ran(members)) \
                        or not self._may_run(members):
                    continue
                memory = math.prod(self._member_ratio(m, "judged_bytes") for m in members)
                speed = math.prod(self._member_ratio(m, "est_step_time_ms") for m in members)
                fits = memory * base["judged_bytes"] <= self.request.limit_bytes
                if fits and speed * (base["est_step_time_ms"] or 0) < fastest:  # may be the answer
                    ready.append(((0, len(members), speed), spec, len(members), True))
                else:  # fits but promises to be slower than one that fits, or does not promise to fit
                    ready.append(((2, 0 if fits else 1, speed if fits else memory), spec, len(members), fits))
        if not ready:
            return None
        # the order of declaration among equals: stable, the same in every process count
        _, spec, members, fits = min(ready, key=lambda item: item[0])
        return spec, members, fits

    def _may_run(self, members: tuple) -> bool:
        """Whether a candidate of `members` is this search's to run: any, but for a search of sharded candidates only
        (`PlanRequest.sharded_only`), where one member must be sharded."""
        return not self.request.sharded_only or any(STRATEGIES.get(m.strategy).distributed for m in members)

    def floor_row(self, spec: str, members: int) -> Row | None:
        """The candidate's row where the floor rules it out (`plan_floor.floor_row`), else None."""
        if spec not in self._floor_rows:
            self._floor_rows[spec] = plan_floor.floor_row(self.request, spec, members, self.floor, self.alone_too)
        return self._floor_rows[spec]

    def rule_out(self, spec: str, row: Row) -> None:
        self.rows[spec] = row
        self.floored.add(spec)

    def tried(self) -> int:
        """The candidates this search started (not those it knew from another, nor those the floor ruled out)."""
        return len(self.rows) - len(self.known) - len(self.floored)

    def _fastest_fitting(self) -> float:
        """The estimated time of the fastest candidate that ran, fits and may be the answer (inf: none yet)."""
        return min((row["est_step_time_ms"] for row in self.rows.values()
                    if row is not None and row["status"] == Status.OK.value and row["est_step_time_ms"] is not None
                    and row["judged_bytes"] is not None and row["judged_bytes"] <= self.request.limit_bytes
                    and (self.request.allow_different or not row["differs_by_design"])), default=math.inf)

    def untried(self) -> tuple[list[str], list[str]]:
        settings = [s.spec for s in self.accepted if s.spec not in self.rows and self._may_run((s,))]
        combinations = [spec for members, spec in self.combinations()
                        if spec not in self.rows and self._may_run(members)]
        return settings, combinations


def _left(queue: _Queue, request: plan.PlanRequest, elapsed_s: float) -> str:
    """What a candidate's progress line says of the rest of the search: the candidates known and not started yet
    (combinations become known as their members finish, so more may come), the time they take at the mean wall time
    of the candidates finished so far, and when the search stops starting new ones (`max_search_s`)."""
    if queue.base() is None:
        return ""
    settings, combinations = queue.untried()
    traced = [spec for spec in settings if queue.floor_row(spec, 1) is None] \
        + [spec for spec in combinations if queue.floor_row(spec, spec.count("+") + 1) is None]
    done = sum(1 for spec, row in queue.rows.items()
               if row is not None and spec not in queue.known and spec not in queue.floored)
    left = min(len(traced), max(0, request.max_candidates - queue.tried()))
    stop = max(0.0, request.max_search_s - elapsed_s)
    limit = f"; no new candidate after {eta.duration(stop)} more" if math.isfinite(stop) else ""
    return f" ({eta.left_text(left, done, elapsed_s, 'known candidates')}{limit})"


def _rule_out_the_rest(queue: _Queue) -> None:
    """The candidates a search cut short knew of and the floor rules out, given their rows: they trace nothing (a
    triple of pairs so ruled out becomes known as they are)."""
    while True:
        settings, combinations = queue.untried()
        ruled_out = [(spec, row) for spec in settings + combinations
                     if (row := queue.floor_row(spec, spec.count("+") + 1)) is not None]
        if not ruled_out:
            return
        for spec, row in ruled_out:
            queue.rule_out(spec, row)


def _combinations_of(pool: list, size: int) -> list[tuple]:
    return list(itertools.combinations(pool, size))


default_jobs = pools.default_jobs


def search(request: plan.PlanRequest, progress: Callable[[str], None] = lambda text: None,
           executor: str = pools.LOCAL, ray_address: str | None = None) -> Searched:
    """Every candidate's row, in the order above, until `max_candidates` have started or `max_search_s` has passed
    (no candidate starts after it; the baseline always runs), in `request.jobs` processes; with `executor="ray"`,
    each candidate a Ray task on the cluster at `ray_address` (None: a local Ray for this search), `request.jobs`
    at once (0: the cluster's CPUs)."""
    context = plan.bind_for_plan(request.case("baseline"), request.ranks)[1]
    # a budget plan of checkpointing gets the limit less the context: its plan is judged on predicted peaks
    space = PlanSpace(context, max(1, request.limit_bytes - request.context_bytes), request.gpus_per_node)
    accepted, refused = plan_candidates.settings(space)
    if request.strategies:  # `plan --strategies`: the candidates are these strategies' settings and combinations
        accepted = [s for s in accepted if s.strategy in request.strategies]
        refused = [r for r in refused if r.spec.split(":")[0] in request.strategies]
    # the parameters and optimizer state of every combination that keeps the baseline's: one over the limit by them
    # alone gets its row here, with no trace (`plan_floor`); not counted on several ranks, where every candidate has
    # a sharded member, which never keeps it
    floor = plan_floor.training_state_bytes(request.workload) \
        if request.device == "cuda" and not request.sharded_only else None
    # and settings alone too, where their ratios can make no combination that could fit
    alone_too = floor is not None and floor + request.context_bytes > request.limit_bytes \
        and not plan_floor.ratios_may_combine(request, [s.spec for s in accepted])
    queue = _Queue(request, accepted, context, floor, alone_too)
    on_ray = executor == pools.RAY
    started, stopped = time.monotonic(), None
    running: dict[futures.Future, str] = {}
    # locally the baseline here, then the workers: forked after it, they inherit what its step warmed (the batch,
    # the fake tensors' dispatch caches), and the first settings start knowing the baseline. On Ray the baseline is
    # a task too, alone, for the same reason: the settings start knowing it
    pool = pools.ray(request.jobs or None, ray_address, request.workload) if on_ray else pools.Inline()
    jobs, task = (pool.slots, plan_tasks.evaluate_on_ray) if on_ray else (max(1, request.jobs), plan_tasks.evaluate)
    extra = (str(fake_cuda.VENV),) if on_ray else ()
    if not on_ray:
        pools.start_server(jobs, __name__, request.workload)  # its imports beside the baseline's step
    as_json = asdict(request)
    try:
        while True:
            if isinstance(pool, pools.Inline) and jobs > 1 and queue.base() is not None:
                pool = _executor(jobs, request.workload)
            while len(running) < (pool.slots if queue.base() is not None else 1):
                late = queue.rows and time.monotonic() - started > request.max_search_s
                full = queue.tried() >= request.max_candidates
                if late or full:
                    stopped = stopped or (TIME if late else COUNT)
                    break
                candidate = queue.next()
                if candidate is None:
                    break
                spec, members, promises_to_fit = candidate
                floored = queue.floor_row(spec, members)
                if floored is not None:
                    queue.rule_out(spec, floored)
                    continue
                queue.rows[spec] = None
                progress(f"[{queue.tried()}/{request.max_candidates} at most, {time.monotonic() - started:.0f} s] "
                         f"{spec} ...{_left(queue, request, time.monotonic() - started)}")
                # one that promises to fit is replayed without a look at its full-size step first (`plan.evaluate`)
                running[pool.submit(task, as_json, spec, members, True, not promises_to_fit, *extra)] = spec
            if not running:
                break
            done, _ = futures.wait(running, return_when=futures.FIRST_COMPLETED)
            for future in done:
                spec = running.pop(future)
                try:
                    queue.rows[spec] = future.result()
                except pool.lost as error:  # a worker died (the OOM killer, a lost node): its candidate is an error
                    queue.rows[spec] = plan_tasks.lost_row(request, spec, error)
                    if isinstance(error, BrokenProcessPool):
                        pool = pool.restarted()
    except BaseException:
        pools.end(pool)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    _rule_out_the_rest(queue)
    elapsed = time.monotonic() - started
    rows = [row for spec, row in queue.rows.items() if row is not None and spec not in queue.known]
    for item in refused:
        if item.spec not in queue.rows and (not request.sharded_only
                                            or STRATEGIES.get(item.spec.split(":")[0]).distributed):
            row = plan.empty_row(request, item.spec, 1)
            row.update(status=Status.UNSUPPORTED.value, message=item.reason)
            rows.append(row)
    untried_settings, untried_combinations = queue.untried() if stopped else ([], [])
    if stopped and not untried_settings and not untried_combinations:
        stopped = None  # it stopped when nothing was left to try
    return Searched(rows, stopped, untried_settings, untried_combinations,
                    elapsed / max(1, queue.tried()), jobs, queue.tried(), floor)


def search_where_cuda_runs(request: plan.PlanRequest, progress: Callable[[str], None],
                           executor: str = pools.LOCAL, ray_address: str | None = None) -> tuple[Searched, str]:
    """`search`, for a CUDA plan on CUDA's own operators: here when this torch sees a CUDA device, else in the
    fake-CUDA environment's Python (`python -m bench.analysis._plan_worker`), else here on the CPU's operators
    with a note saying so. On Ray the search runs here and each task finds CUDA's operators on its node
    (`plan_tasks.evaluate_on_ray`)."""
    if executor == pools.RAY:
        searched = search(request, progress, executor, ray_address)
        where = f"the Ray cluster at {ray_address}" if ray_address else "a local Ray"
        return searched, (f"each candidate a Ray task in a fresh worker process on {where}, {searched.jobs} at "
                          "once; the CPU time is this process's, not the tasks'")
    if request.device != "cuda" or torch.cuda.is_available():
        return search(request, progress), ""
    python = fake_cuda.environment_python()
    if python is None:
        return search(request, progress), f"{fake_cuda.unavailable_reason()}: predicted on the CPU's operators"
    answer, why = run_in_fake_cuda(python, "bench.analysis._plan_worker", asdict(request), whole=True)
    if answer is not None:
        return Searched.from_json(answer), ""
    return search(request, progress), f"the fake-CUDA environment failed ({why[:200]}): predicted here"
