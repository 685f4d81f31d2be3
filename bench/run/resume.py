"""`run --resume results/<run>.csv`: the finished cases of an interrupted run, and which cases are left.

A case is identified by `results.CASE_KEY` (workload, strategy, phase, device, batch_size, data). Rows with
status ok, oom, unsupported or timeout are finished and kept (a case stopped at --case-timeout would only spend the
limit again: resuming never walks back into a case that does not return); `error` rows (a crashed worker, a
transient failure) are dropped and their cases run again, so the file ends with each case exactly once.

Consistency: a resumed run must measure the remaining cases the way the finished ones were measured, or its
rows would not be comparable. So the options that change the figures -- warm-up steps, the timing
options (a fixed count, or adaptive timing's minimum, budget and target; schema 4), repeats,
threads, determinism -- must equal those stored in the CSV; otherwise resuming is refused with a UsageError
that names each difference (start a new run instead). Isolation changes only how process-wide state is
contained, so a difference there is allowed, with a warning on stderr.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from bench.core.errors import UsageError
from bench.core.results import CASE_KEY, SCHEMA_VERSION, Status, newer_schema_version, read_results_file
from bench.run.isolation import RunOptions

FINISHED = tuple(status.value for status in (Status.OK, Status.OOM, Status.UNSUPPORTED, Status.TIMEOUT))


@dataclass
class Resumed:
    """What a resumed run starts from."""

    path: Path
    run_id: str
    rows: list[dict]  # finished rows, kept as they are
    remaining: list  # cases still to run, in the requested order


def _key(values) -> tuple:
    return tuple(str(values[k]) for k in CASE_KEY)


def _stored(frame: pd.DataFrame, column: str):
    """The single value of `column` in the file (None when absent or empty)."""
    if column not in frame:
        return None
    values = frame[column].dropna().unique()
    return values[0] if len(values) else None


def _shown(value) -> str:
    return "adaptive timing" if value is None else str(value)


def _same(stored, wanted) -> bool:
    if wanted is None:
        return stored is None  # an option that does not apply must not have been set either
    if stored is None:
        return True  # an older file without the column: nothing to compare
    if isinstance(wanted, bool):
        return str(stored).lower() == str(wanted).lower()
    try:
        return float(stored) == float(wanted)
    except (TypeError, ValueError):
        return str(stored) == str(wanted)


# what a run measures: a file's rows of one workload, device or data source that the resumed command does not ask
# for mean the command is another run's (its rows would go into this one, under this run's id)
SWEEP_AXES = {"workload": "--workload", "device": "--device", "data": "--data"}


def _check_same_sweep(path: Path, frame: pd.DataFrame, cases: list) -> None:
    """Each workload, device and data source of the file's rows is among those of `cases` (the resumed command
    may reach ones the run had not yet: an interrupted sweep); a UsageError naming the first that is not."""
    if not cases:
        return
    for column, option in SWEEP_AXES.items():
        if column not in frame:
            continue
        asked = {str(getattr(case, column)) for case in cases}
        stored = [str(v) for v in frame[column].dropna().unique()]
        missing = [v for v in stored if v not in asked]
        if missing:
            raise UsageError(f"cannot resume {str(path)!r}: its run measured {column} {missing[0]!r}, which this "
                             f"command does not ask for ({option} {', '.join(sorted(asked))}); resume with the run's "
                             "own options, or start a new run (without --resume)")


def load_resume(path: Path | str, cases: list, options: RunOptions) -> Resumed:
    """Reads the run at `path`, checks that `cases`/`options` are consistent with it, and splits off what is done."""
    path = Path(path)
    frame = read_results_file(path, "cannot resume")
    newer = newer_schema_version(frame)
    if newer is not None:  # its rows mean what a newer membench says they mean
        raise UsageError(f"cannot resume {str(path)!r}: it was written by a newer membench (schema_version "
                         f"{newer}; this one writes {SCHEMA_VERSION}); resume it with that version, or start a new "
                         "run")
    run_ids = frame["run_id"].dropna().unique()
    run_id = str(run_ids[0]) if len(run_ids) else path.stem
    _check_same_sweep(path, frame, cases)
    options = options.resolved()
    differences = []
    if cases:
        case = cases[0]
        wanted = {"warmup_steps": case.warmup}
        if _stored(frame, "timing_fixed_steps") is not None or _stored(frame, "timing_min_steps") is not None:
            # schema 4: the timing options are recorded (empty where they did not apply)
            wanted.update(timing_fixed_steps=case.steps, timing_min_steps=None if case.steps else case.min_steps,
                          timing_max_time_s=None if case.steps else case.max_time_s,
                          timing_target_ci_rel=None if case.steps else case.target_ci_rel)
        else:  # an older file: every case timed `measured_steps` steps
            wanted["measured_steps"] = case.steps
        for column, value in wanted.items():
            if not _same(_stored(frame, column), value):
                differences.append(f"{column}: file has {_stored(frame, column)}, requested {_shown(value)}")
    for column, value in {"repeats": options.repeats, "cpu_threads": options.threads, "ranks": options.ranks,
                          "deterministic": options.deterministic}.items():
        if not _same(_stored(frame, column), value):
            differences.append(f"{column}: file has {_stored(frame, column)}, requested {value}")
    if differences:
        raise UsageError(f"cannot resume {str(path)!r} with different measurement options ("
                         + "; ".join(differences) + "); pass the run's options or start a new run")
    stored_isolated = _stored(frame, "isolated")
    if not _same(stored_isolated, options.isolate):
        print(f"warning: {path} was run with isolated={stored_isolated}; resuming with isolated={options.isolate}",
              file=sys.stderr)
    finished = frame[frame["status"].isin(FINISHED)].drop_duplicates(CASE_KEY, keep="last")
    rows = [{k: (None if isinstance(v, float) and v != v else v) for k, v in r.items()}
            for r in finished.to_dict("records")]
    done = {_key(r) for r in rows}
    # the strategy as rows spell it: the case's parsed spec, canonical (members sorted, default options left out)
    remaining = [c for c in cases if _key({"workload": c.workload, "strategy": c.strategy.spec(),
                                           "phase": c.phase, "device": c.device, "batch_size": c.batch_size,
                                           "data": c.data}) not in done]
    return Resumed(path, run_id, rows, remaining)
