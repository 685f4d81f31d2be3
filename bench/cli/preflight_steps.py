"""The pre-flight steps that run the user's model before the first case (the memory estimate on meta, the first
case's calibration): in this process with its global state restored, or under --isolate in a child process, so
that a workload that calls `os._exit` or crashes ends neither the run nor the rows its cases become.

`python -m bench.cli.preflight_steps` is the child: it reads {"cases", "check_memory", "memory_limit_s",
"calibration_limit_s"} as JSON on stdin and prints {"usage_error", "note"} as one `MEMBENCH_PREFLIGHT {json}` line
on stdout; its warnings go to its stderr, which the parent passes on. Given {"resolve": [spec, ...]} instead, it
only imports and builds those workloads (`workloads_resolve_in_child`: a user's file that exits on import).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from dataclasses import replace

from bench.core.errors import UsageError
from bench.core.processes import run_child

RESULT_MARKER = "MEMBENCH_PREFLIGHT "
CHILD_IMPORT_S = 60.0  # the child's own start (importing torch and the workload) on a loaded machine
ALARM_REPEAT_S = 0.1  # how often a bound that has expired tells the estimate again (see _bounded)


def user_code_steps(cases: list, check_memory: bool, memory_limit_s: float | None,
                    calibration_limit_s: float) -> str | None:
    """In this process: the memory check of `cases` (a UsageError where the largest batch cannot fit) when
    `check_memory`, and the first case's note (None where its calibration failed), each bounded in seconds; global
    torch state (default dtype, grad mode, ...) restored after, and a workload's sys.exit taken as a failed
    estimate (the case itself becomes a row that says so)."""
    from bench.run import preflight
    from bench.run.isolation import process_state

    with process_state():
        if check_memory:
            preflight.check_memory(cases, _bounded(memory_limit_s, _meta_baseline_peak))
        try:
            return _bounded(calibration_limit_s, _first_case_note)(cases)
        except SystemExit:
            return None


def user_code_steps_in_child(cases: list, check_memory: bool, memory_limit_s: float | None,
                             calibration_limit_s: float) -> str | None:
    """`user_code_steps` in a fresh process; a child that ends without a result (the workload's code exited or
    crashed) is a warning line and no check: each case then runs in its own worker and its row says why."""
    from bench.run.isolation import worker_env

    job = {"cases": [case.to_json() for case in cases], "check_memory": check_memory,
           "memory_limit_s": memory_limit_s, "calibration_limit_s": calibration_limit_s}
    limit = CHILD_IMPORT_S + (memory_limit_s or 0) * max(len(cases), 1) + calibration_limit_s
    try:
        done = run_child([sys.executable, "-m", "bench.cli.preflight_steps"], input=json.dumps(job), text=True,
                         capture_output=True, env=worker_env(), timeout=limit)
    except subprocess.TimeoutExpired:
        _warn(f"the pre-flight checks did not finish within {limit:g} s; the cases run without them")
        return None
    for line in done.stderr.splitlines():
        if line.startswith("warning: "):
            print(line, file=sys.stderr, flush=True)
    result = next((json.loads(line[len(RESULT_MARKER):]) for line in done.stdout.splitlines()
                   if line.startswith(RESULT_MARKER)), None)
    if result is None:
        _warn(f"the pre-flight checks (memory estimate, calibration) ended without a result (exit code "
              f"{done.returncode}): the workload's code exited or crashed; each case runs in its own process")
        return None
    if result["usage_error"]:
        raise UsageError(result["usage_error"])
    return result["note"]


def workloads_resolve_in_child(specs: list[str]) -> None:
    """Imports and instantiates the user's workloads `specs` in a fresh process first, under --isolate: this
    process imports them next, and a module or `__init__` that calls `os._exit` would end it with no word. A child
    that ends without a result is a WorkloadCodeError of one line naming the spec; a bad spec the UsageError the
    child raised."""
    from bench.core.errors import WorkloadCodeError
    from bench.run.isolation import worker_env

    for spec in specs:
        done = run_child([sys.executable, "-m", "bench.cli.preflight_steps"], text=True, capture_output=True,
                         input=json.dumps({"resolve": [spec]}), env=worker_env(), timeout=CHILD_IMPORT_S * 5)
        result = next((json.loads(line[len(RESULT_MARKER):]) for line in done.stdout.splitlines()
                       if line.startswith(RESULT_MARKER)), None)
        if result is None:
            raise WorkloadCodeError(f"the workload's code ended the process (exit code {done.returncode}) while "
                                    f"{spec!r} was imported and built, before any case: a workload must return, "
                                    "not exit")
        if result["usage_error"]:
            raise UsageError(result["usage_error"])


def user_workload_specs(specs: list[str]) -> list[str]:
    """The specs among `specs` that name the user's code (a file or a module), not a registered workload."""
    from workloads import WORKLOADS

    return [spec for spec in specs if str(spec).strip().split(":")[0] not in WORKLOADS]


def _bounded(seconds: float | None, estimate):
    """`estimate(*args)` (the pre-flight's meta-device peak, which runs the model's forward in this process) raising
    TimeoutError after `seconds`, so that a model that never returns cannot hang the run before its first case;
    the pre-flight skips a case whose estimate raises. SIGALRM: the main thread of a POSIX process only.

    The alarm repeats until the estimate returns, because one TimeoutError can be swallowed (a library's
    `except Exception` around an optional import, say) and a model that never returns would then never be told
    again; and it waits while a module is being imported, because an import cut short leaves a half-made module
    behind (`module 'sympy' has no attribute 'core'` in every later step of the process)."""
    if not seconds or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        return estimate
    armed = [True]

    def expire(signum, frame):
        if armed[0] and not _importing(frame):
            raise TimeoutError(f"the pre-flight memory estimate took over {seconds:g} s")

    def bounded(*args):
        previous = signal.signal(signal.SIGALRM, expire)
        armed[0] = True
        signal.setitimer(signal.ITIMER_REAL, seconds, ALARM_REPEAT_S)
        try:
            return estimate(*args)
        finally:
            armed[0] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    return bounded


def _importing(frame) -> bool:
    """Whether `frame` runs inside an import (importlib's bootstrap is on its stack)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def _meta_baseline_peak(case, batch_size: int) -> int:
    """The baseline's exact tracked peak of `case` at `batch_size`, on the meta device (no memory used), with torch's
    global state restored after it: a workload whose model sets the default dtype must not double the next
    workload's estimate."""
    from bench.analysis.fake_engine import tracked_peak
    from bench.run.isolation import process_state

    with process_state():
        return tracked_peak(replace(case, batch_size=batch_size, strategy="baseline"), "baseline",
                            engine="meta", block_bytes=1)


def _first_case_note(cases: list) -> str | None:
    """On the CPU: how long the first case will take, from two real baseline steps at small batches (a second or
    so); None where that calibration fails (the case's own row will say why)."""
    from bench.run.eta import calibrated_step_seconds, first_case_note

    if not cases or cases[0].device != "cpu":
        return None
    try:
        return first_case_note(cases[0], calibrated_step_seconds(cases[0]))[0]
    except Exception:  # noqa: BLE001 - an estimate only (or TimeoutError, see _bounded): the case says it as a row
        return None


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def main() -> int:
    from bench.run.case import Case

    job = json.loads(sys.stdin.read())
    if "resolve" in job:
        return _resolve(job["resolve"])
    cases = [Case(**case) for case in job["cases"]]
    result = {"usage_error": None, "note": None}
    try:
        result["note"] = user_code_steps(cases, job["check_memory"], job["memory_limit_s"],
                                         job["calibration_limit_s"])
    except UsageError as error:
        result["usage_error"] = str(error)
    sys.stdout.write(RESULT_MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


def _resolve(specs: list[str]) -> int:
    from workloads import get_workload

    result = {"usage_error": None, "note": None}
    try:
        for spec in specs:
            get_workload(spec)
    except UsageError as error:
        result["usage_error"] = str(error)
    sys.stdout.write(RESULT_MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
