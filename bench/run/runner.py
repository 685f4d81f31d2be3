"""Runs cases: each one verified against the baseline, timed, and measured for memory, in separate passes; and
sweeps of cases through an executor (here, in worker processes, on Ray), each row written as its case finishes.

The pieces live by concern: `bench.run.case` (Case, binding, seeding), `bench.run.session` (the training loop),
`bench.run.verify` (the comparison with the baseline), `bench.run.passes` (timing and memory), `bench.run.rows`
and `bench.run.result` (a case's row and side data). The names of the passes, rows, session and verification that
the rest of membench uses are importable from here too; a case and its binding are imported from `bench.run.case`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable, Iterator

import pandas as pd
import torch

from bench.core.errors import Unsupported, UsageError, WorkloadCodeError
from bench.core.results import Status, new_run_id, now_iso, write_csv_atomic, write_rows
from bench.measure import snapshot as memory_snapshot, timing
from bench.measure.cpu_16bit import emulated_dtype
from bench.measure.env import environment
from bench.measure.resident import RESIDENT_COLUMNS, ResidentMeter, release_host_memory
from bench.measure.stats import summarize_timing
from bench.run.case import Case, bind_case, rule_of_thumb_bytes
from bench.run.fake_pass import fake_memory_pass
from bench.run.isolation import RunOptions, process_state, run_in_worker
from bench.run.passes import (  # noqa: F401
    MEMORY_GROWTH_STEPS, MEMORY_WARMUP_STEPS, CaseMeter, MemoryResult, TimingResult, allocator_memory_pass,
    forget_traceback, memory_pass, release_cuda_memory, timing_pass,
)
from bench.run.ranks import in_rank_process, run_on_ranks
from bench.run.result import CaseResult
from bench.run.rows import (  # noqa: F401
    base_row, declared_columns, is_oom, measured_columns, peak_columns, settings_text,
    workload_columns,
)
from bench.run.session import Session  # noqa: F401
from bench.run.verify import NonFiniteLoss, baseline_snapshot, compare, snapshot, verify  # noqa: F401
from strategies import Strategy


def measure_case(case: Case, env: dict | None = None, options: RunOptions | None = None,
                 verify_result: bool = True) -> CaseResult:
    """One case's row -- the case, its verification, timing and memory, and its status (ok, oom, unsupported,
    error) -- with its side data (each repeat's step times and peak, the step timeline).

    In this process, inside `process_state` (threads and determinism set, every process-wide flag restored
    afterwards). With `options.repeats` K > 1 the timing pass and the memory pass run K times each:
    `peak_mem_bytes` is the largest peak and `peak_mem_spread_bytes` the largest minus the smallest (0 on the
    CPU, where the count is exact). `verify_result=False` skips the comparison with the baseline (later repeats of
    an isolated case).
    """
    options = options or RunOptions()
    resident = ResidentMeter().start()  # the process at rest (its mmap threshold pinned first), peak RSS from here
    result = CaseResult(base_row(case, env, options))  # whose environment records the threshold just pinned
    row = result.row
    with process_state(options.threads, options.deterministic):
        row["cpu_threads"] = torch.get_num_threads()
        try:
            strategy, context = bind_case(case, options.ranks)
            row.update(workload_columns(context.workload))
            row["strategy"] = strategy.spec()
            strategy.check(context)
            row.update(declared_columns(strategy))
            emulated = row["emulated_16bit"] = emulated_dtype(strategy, case.device) is not None
            if strategy.distributed and not in_rank_process():
                return _merged_ranks(result, run_on_ranks(case, env, options, verify_result))
            strategy.plan(CaseMeter(case))
            if verify_result:
                verified = emulated_verification(case, strategy, options.ranks) if emulated else (case, strategy)
                row.update(verify(*verified), verify_batch_size=verified[0].batch_size)
                release_host_memory()  # the verification's sessions, freed: their pages back to the system
                if emulated:
                    row["message"] = "; ".join(filter(None, [row.get("message"), emulated_note(verified[0])]))
            _measure(case, strategy, options.repeats, result, emulated, options.snapshot_dir)
            row.update(declared_columns(strategy))  # with what the model resolved (segments=auto, the plan)
        except WorkloadCodeError as error:  # the user's workload failed to build here: a failure, not a finding
            row.update(status=Status.ERROR.value, message=str(error)[:500])
        except (Unsupported, UsageError) as error:
            # a value the pre-run checks (bench.run.preflight) let through that this one case cannot take: its row
            # says so and the sweep goes on with the unrelated cases after it
            row.update(status=Status.UNSUPPORTED.value, message=str(error))
        except NonFiniteLoss as error:  # the figures of a step on NaNs are not the workload's: none are kept
            row.update(status=Status.ERROR.value, message=str(error)[:500])
        except Exception as error:  # noqa: BLE001 - any failure becomes a row and the sweep goes on
            row.update(status=(Status.OOM if is_oom(error) else Status.ERROR).value,
                       message=f"{type(error).__name__}: {error}".splitlines()[0][:500])
            forget_traceback(error)
        except SystemExit as error:  # the workload's own code called sys.exit: its row, not the end of the sweep
            row.update(status=Status.ERROR.value, message=exited_message(error))
        finally:
            if case.device == "cuda":
                release_cuda_memory()
            if row.get("process_peak_rss_bytes") is None:  # a sharded case's come from its ranks
                row.update(resident.columns(row.get("peak_mem_bytes") if row["status"] == Status.OK.value else None))
    return result


def exited_message(error: SystemExit) -> str:
    """The row's message for a case whose workload (or strategy) code called sys.exit."""
    return f"the workload's code called sys.exit({error.code!r}) during the case; no figures were kept"[:500]


# A 16-bit case whose arithmetic the CPU emulates (bench.measure.cpu_16bit.emulated_dtype; 15-23x slower than float32 on
# the reference AMD EPYC, 83 s a step at batch 100) runs real steps only where values matter: its verification at
# this batch at most (the comparison with the baseline needs real arithmetic, not a large batch) and its timing,
# with no warm-up step, at least one timed step and at most EMULATED_MAX_TIME_S seconds of them. Its memory is
# counted on fake tensors (bench.run.fake_pass: the same tracked step, no arithmetic, equal to the real count to the
# byte: tests/test_emulated16.py), marked `cpu_fake_live_tensor_bytes`.
EMULATED_VERIFY_BATCH = 4
EMULATED_MAX_TIME_S = 10.0


def emulated_verification(case: Case, strategy: Strategy, ranks: int = 1) -> tuple[Case, Strategy]:
    """The case and strategy an emulated 16-bit case is verified with: at min(batch, EMULATED_VERIFY_BATCH), the
    strategy bound (and planned) at that batch."""
    if case.batch_size <= EMULATED_VERIFY_BATCH:
        return case, strategy
    small = replace(case, batch_size=EMULATED_VERIFY_BATCH)
    bound, context = bind_case(small, ranks)
    bound.check(context)
    bound.plan(CaseMeter(small))
    return small, bound


def emulated_note(verified: Case) -> str:
    """What the row of an emulated 16-bit case says of how it was measured."""
    return (f"16-bit arithmetic emulated by this CPU: verified at batch {verified.batch_size}, memory counted on "
            f"fake tensors, timing with no warm-up and at most {EMULATED_MAX_TIME_S:g} s of steps")


def emulated_timing_case(case: Case) -> Case:
    """The case as an emulated 16-bit case is timed: no warm-up step, adaptive from one timed step, at most
    EMULATED_MAX_TIME_S seconds of steps (or the case's smaller budget); a fixed count (`--steps`, `--quick`) too."""
    budget = EMULATED_MAX_TIME_S if case.steps is not None else min(case.max_time_s, EMULATED_MAX_TIME_S)
    return replace(case, warmup=0, steps=None, min_steps=1, max_time_s=budget)


def emulated_memory_pass(case: Case, strategy: Strategy, record_timeline: bool = False,
                         record_snapshot: bool = False) -> MemoryResult:
    """The memory pass of an emulated 16-bit case: on fake tensors; a real one where the strategy is counted at the
    allocator or cannot run on fake tensors."""
    recording = {"record_timeline": record_timeline, "record_snapshot": record_snapshot}
    if strategy.cpu_memory_count == "allocator_events":
        return memory_pass(case, strategy, **recording)
    try:
        measured = fake_memory_pass(case, strategy, **recording)
    except Exception as error:  # noqa: BLE001 - what fake tensors cannot run is counted on real ones
        forget_traceback(error)
        return memory_pass(case, strategy, **recording)
    measured.columns["memory_method"] = "cpu_fake_live_tensor_bytes"
    return measured


def _measure(case: Case, strategy: Strategy, repeats: int, result: CaseResult, emulated: bool = False,
             snapshot_dir: str | None = None) -> None:
    """The timing pass and `repeats` memory passes into `result` (the first training one records the timeline,
    and with `snapshot_dir` the first one's snapshot is written there); an `emulated` 16-bit case is timed as
    `emulated_timing_case` says and counted on fake tensors."""
    timed_case = emulated_timing_case(case) if emulated else case
    timed = timing_pass(timed_case, strategy, repeats)
    result.row.update(timed, warmup_steps=timed_case.warmup)
    result.step_times_ms = timed.step_times_ms
    release_host_memory()
    measure_memory = emulated_memory_pass if emulated else memory_pass
    for index in range(repeats):
        measured = measure_memory(case, strategy, record_timeline=index == 0 and case.phase == "train",
                                  record_snapshot=index == 0 and snapshot_dir is not None)
        if index == 0 and snapshot_dir is not None:
            save_snapshot(measured, case, result.row, snapshot_dir)
        if measured.tracker is not None and measured.tracker.timeline:
            result.timeline = [asdict(point) for point in measured.tracker.timeline]
        result.peaks.append(measured["peak_mem_bytes"])
    result.row.update(measured, **peak_columns(result.peaks))
    result.row.update(measured_columns(strategy))
    result.row["rule_of_thumb_bytes"] = rule_of_thumb_bytes(case)


def save_snapshot(measured: MemoryResult, case: Case, row: dict, folder: str) -> None:
    """Writes the memory pass's snapshot of the case (this rank's, in a rank process) into `folder`: CUDA's own
    recording, or one written from the tracker's log; nothing where the pass kept neither (the CPU allocator's
    count)."""
    about = {key: row.get(key) for key in ("workload", "strategy", "phase", "batch_size", "device")}
    about.update(data=case.data, kind="measured", peak_mem_bytes=measured["peak_mem_bytes"],
                 rank=torch.distributed.get_rank() if in_rank_process() else None)
    if measured.cuda_snapshot:
        recorded = measured.cuda_snapshot
        memory_snapshot.write_snapshot({**recorded, "membench": {**recorded["membench"], **about}}, Path(folder))
    elif measured.tracker is not None and measured.tracker.record_events:
        memory_snapshot.write_snapshot(memory_snapshot.tracker_snapshot(measured.tracker, about), Path(folder))


def _merged_ranks(result: CaseResult, ranks: CaseResult) -> CaseResult:
    """This process's row with the merged row of a case run as several ranks, and the ranks' side data."""
    result.row.update(ranks.row)
    result.step_times_ms, result.peaks, result.timeline = ranks.step_times_ms, ranks.peaks, ranks.timeline
    return result


def run_case(case: Case, env: dict | None = None, options: RunOptions | None = None,
             verify_result: bool = True) -> dict:
    """One row of the results table for the case (`measure_case` without its side data)."""
    return measure_case(case, env, options, verify_result).row


def run_case_isolated(case: Case, env: dict | None, options: RunOptions) -> CaseResult:
    """`measure_case` with each of the K repeats in a fresh worker process; the repeats' figures pooled.

    The first repeat also verifies against the baseline. A repeat that does not end `ok` (a crashed worker
    included) ends the case, and its row is the case's row. With `options.case_timeout_s` all repeats share one
    deadline: the worker running at it is killed and the case is a `timeout` row.
    """
    repeats = []
    deadline = None if options.case_timeout_s is None else time.monotonic() + options.case_timeout_s
    for index in range(options.repeats):
        left = None if deadline is None else max(deadline - time.monotonic(), 0.1)
        result = with_base_row(case, env, options, run_in_worker(case, env, options, verify=index == 0, timeout=left))
        if result.row["status"] != Status.OK.value:
            return pool_repeats(case, [result], options)
        repeats.append(result)
    return pool_repeats(case, repeats, options)


def with_base_row(case: Case, env: dict | None, options: RunOptions, result: CaseResult) -> CaseResult:
    """`result` (from another process) over the case's base row, so that a worker that died still has a full row."""
    row = base_row(case, env, options)
    row.update(result.row)
    result.row = row
    return result


def pool_repeats(case: Case, repeats: list[CaseResult], options: RunOptions) -> CaseResult:
    """The result of a case whose repeats ran in separate processes: the first repeat's row (it verified), with
    the timing and peaks of all repeats pooled; a repeat that did not end `ok` is the case's result."""
    failed = [r for r in repeats if r.row["status"] != Status.OK.value]
    first = failed[0] if failed else repeats[0]
    pooled = CaseResult(first.row.copy(), first.step_times_ms, first.peaks, first.timeline, first.worker_exit_code)
    row = pooled.row
    row.update(isolated=True, repeats=options.repeats)
    if failed:
        return pooled
    times = [t for r in repeats for t in r.step_times_ms]
    pooled.step_times_ms, pooled.peaks = times, [p for r in repeats for p in r.peaks]
    row.update(summarize_timing(case.batch_size, times), **peak_columns(pooled.peaks))
    # each repeat ran in its own process: the case's resident figures are those of the one that held the most
    largest = max(repeats, key=lambda r: r.row.get("process_peak_rss_bytes") or 0).row
    row.update({column: largest.get(column) for column in RESIDENT_COLUMNS})
    reasons = ",".join(r.row["timing_stop_reason"] for r in repeats).split(",")
    row.update(measured_steps=sum(len(t) for t in times), timing_stop_reason=",".join(dict.fromkeys(reasons)),
               timing_ci_rel=timing.median_ci_rel_width([t for repeat in times for t in repeat]),
               timing_pass_s=sum(r.row["timing_pass_s"] for r in repeats))
    return pooled


# An executor runs cases and yields (index in `cases`, case, result) as each case finishes, in any order; it calls
# `started(index, case)` when a case begins, if it knows. bench.run.ray_executor is another.
Executor = Callable[[list[Case], RunOptions, Callable[[int, Case], None]], Iterator[tuple[int, Case, CaseResult]]]


def local_executor(cases: list[Case], options: RunOptions,
                   started: Callable[[int, Case], None]) -> Iterator[tuple[int, Case, CaseResult]]:
    """Cases one after the other on this machine: in this process, or each in fresh worker processes."""
    envs: dict[str, dict] = {}
    for index, case in enumerate(cases):
        started(index, case)
        env = envs.setdefault(case.device, environment(case.device))
        if options.isolate:
            yield index, case, run_case_isolated(case, env, options)
        else:
            yield index, case, measure_case(case, env, options)


class StepTimeline:
    """Live bytes after each operator of one training step per case, kept in `<run>.timeline.csv` beside the results.

    The chart of memory over a step is drawn from this file. A resumed run keeps the points already on disk; a case
    added again (run again after its results row was not written: a full disk) replaces its earlier points.
    `run_cases` writes this file before the results CSV: the CSV is what `--resume` trusts as finished, so a case
    whose points could not be written is not in it either, and runs again.
    """

    COLUMNS = ["workload", "strategy", "phase", "device", "batch_size", "data", "index", "stage", "op", "live_bytes"]
    CASE_COLUMNS = ("workload", "strategy", "phase", "device", "batch_size", "data")

    def __init__(self, results_path: Path | None):
        self.path = None if results_path is None else Path(results_path).with_suffix(".timeline.csv")
        self.frames: list[pd.DataFrame] = []
        if self.path is not None and self.path.exists():
            self.frames.append(pd.read_csv(self.path))
        self.changed = False

    def add(self, row: dict, points: list[dict] | None) -> None:
        """The points of one case, keyed by its row's case columns (the strategy as the row spells it)."""
        if not points:
            return
        frame = pd.DataFrame(points)
        for key in self.CASE_COLUMNS:
            frame[key] = row[key]
        same = tuple(str(row[key]) for key in self.CASE_COLUMNS)
        self.frames = [kept for kept in (self._without(earlier, same) for earlier in self.frames) if len(kept)]
        self.frames.append(frame[self.COLUMNS])
        self.changed = True

    def _without(self, frame: pd.DataFrame, case: tuple) -> pd.DataFrame:
        """`frame` without the points of `case` (its CASE_COLUMNS values as text, as a file read back holds them)."""
        keys = frame[list(self.CASE_COLUMNS)].astype(str).itertuples(index=False, name=None)
        return frame[[key != case for key in keys]]

    def write(self) -> None:
        if self.path is not None and self.changed:
            write_csv_atomic(pd.concat(self.frames, ignore_index=True), self.path)
            self.changed = False


def run_cases(cases: list[Case], out_path: Path | None = None,
              progress: Callable[[int, int, Case, dict | None], None] | None = None,
              options: RunOptions | None = None, previous_rows: list[dict] | None = None,
              run_id: str | None = None, executor: Executor = local_executor) -> list[dict]:
    """Runs every case; after each one finishes the CSV at `out_path` is rewritten atomically with all rows so far.

    `options`: isolation, repeats, threads, determinism (bench.run.isolation.RunOptions; default: in-process, once).
    `executor` runs the cases (default: here, in order; `bench.run.ray_executor.RayExecutor` on a Ray cluster); rows
    are written in the cases' order whatever order they finish in. `previous_rows` (a resumed run's finished
    rows) are written first and returned with the new ones; `run_id` defaults to the file's stem. A reader (or a
    run killed at any moment) never sees a half-written file: each write goes to a temporary file renamed over
    the CSV.
    """
    options = (options or RunOptions()).resolved()
    run_id = run_id or (new_run_id() if out_path is None else Path(out_path).stem)
    finished: dict[int, dict] = {}
    timeline = StepTimeline(out_path)

    def started(index: int, case: Case) -> None:
        if progress:
            progress(index, len(cases), case, None)

    for index, case, result in executor(cases, options, started):
        row = result.row
        row["run_id"] = run_id
        row["timestamp"] = now_iso()  # when the case finished, as results/README.md says
        timeline.add({**row, "workload": case.workload, "data": case.data}, result.timeline)
        finished[index] = row
        if out_path is not None:
            timeline.write()  # first: a case is finished (for --resume) once its row is in the CSV, its points too
            # a new run's first write creates its file, never over another run's (a resumed run rewrites its own)
            write_rows(list(previous_rows or []) + [finished[i] for i in sorted(finished)], out_path,
                       new=previous_rows is None and len(finished) == 1)
        if progress:
            progress(index, len(cases), case, row)
    return list(previous_rows or []) + [finished[i] for i in sorted(finished)]
