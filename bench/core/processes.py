"""Processes that end with the one that started them: signals that stop a command run its cleanup, and children die
with their parent.

SIGINT raises KeyboardInterrupt in Python; SIGTERM (what `timeout`, a scheduler's time limit and a container stop
send) and SIGHUP (a closed terminal) end the process at once by default, so no `finally` runs: worker processes go
on without their parent and temporary files and folders stay. `stop_on_signals()` makes the three alike: the first
raises an exception in the main thread (KeyboardInterrupt for SIGINT, `Terminated` for the others), so every
`with` block unwinds (worker pools ended, temporary folders removed, atomic writes' temporaries deleted); later ones
are ignored while that cleanup runs. A child started with `run_child` (or `die_with_parent` in its first line) gets
SIGTERM from Linux when its parent ends, however it ends (SIGKILL included), and is sent SIGTERM, then SIGKILL after
a grace period, when its parent stops waiting for it because of an exception (`end_children`).

Example:
    stop_on_signals()                      # first thing in a process's entry point
    done = run_child([sys.executable, "-m", "some.worker"], input=job, capture_output=True, text=True)
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Iterator

PR_SET_PDEATHSIG = 1  # linux/prctl.h
TERMINATING = (signal.SIGTERM, signal.SIGHUP)
STOPPING = (signal.SIGINT, *TERMINATING)
GRACE_S = 10.0  # how long a child that was asked to stop may clean up before it is killed


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the main thread is: a KeyboardInterrupt, so that every cleanup written for
    Ctrl-C runs for it too."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_status(error: KeyboardInterrupt) -> int:
    """The exit status of a process stopped by `error`: 128 + the signal's number, as the shell reports a process
    that the signal ended (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP)."""
    return 128 + (error.signum if isinstance(error, Terminated) else signal.SIGINT)


_stopping: dict[str, int | None] = {"signal": None}


def _stop(signum: int, frame: Any) -> None:
    if _stopping["signal"] is not None:
        return  # the cleanup of the first signal is under way: it ends the process
    _stopping["signal"] = signum
    raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)


def stop_on_signals() -> None:
    """SIGINT, SIGTERM and SIGHUP raise KeyboardInterrupt / `Terminated` in the main thread, once (see above). A
    signal this process ignores (SIGHUP under nohup) stays ignored. Only in the main thread of a process's entry
    point: a library must not take over its host's signals."""
    _stopping["signal"] = None
    for signum in STOPPING:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _stop)


def default_signals() -> None:
    """SIGTERM and SIGHUP back to their default (the process ends at once): for a forked worker, which would
    otherwise inherit its parent's `stop_on_signals` and survive the SIGTERM that ends it."""
    for signum in TERMINATING:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)


def _prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up once in the parent (a child between fork and exec should not load libraries)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def die_with_parent(parent_pid: int | None = None, signum: int = signal.SIGTERM) -> None:
    """Asks Linux to send `signum` to this process when its parent ends (prctl PR_SET_PDEATHSIG; nothing elsewhere).
    `parent_pid`: the parent this process was started by; if it ended before the request was made, this process
    ends now."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signum)


def _child_setup(parent_pid: int, then: Callable[[], None] | None) -> Callable[[], None]:
    def setup() -> None:
        die_with_parent(parent_pid)
        if then is not None:
            then()

    return setup


def popen(args, preexec_fn: Callable[[], None] | None = None, **kwargs) -> subprocess.Popen:
    """`subprocess.Popen(args, **kwargs)` whose child gets SIGTERM when this process ends (`die_with_parent`, before
    the `preexec_fn` given, if any). Linux's parent is the calling thread: call it from one that outlives the child."""
    return subprocess.Popen(args, preexec_fn=_child_setup(os.getpid(), preexec_fn), **kwargs)


def end_children(children: list[subprocess.Popen], grace_s: float = GRACE_S) -> None:
    """Ends each of `children` that runs: SIGTERM to all (their `stop_on_signals` cleanup runs), then SIGKILL to
    those still running `grace_s` later."""
    running = [child for child in children if child.poll() is None]
    for child in running:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in running:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


@contextlib.contextmanager
def ended_on_error(children: list[subprocess.Popen], grace_s: float = GRACE_S) -> Iterator[None]:
    """Around code that waits for `children` (a list it may still fill): after an exception (Ctrl-C, SIGTERM, an
    error) those still running are ended (`end_children`) before the exception goes on."""
    try:
        yield
    except BaseException:
        end_children(children, grace_s)
        raise


def run_child(args, input: str | bytes | None = None, timeout: float | None = None, capture_output: bool = False,
              grace_s: float = GRACE_S, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run`, with the child started by `popen` (it dies with this process) and, when this process stops
    waiting because of an exception (Ctrl-C, SIGTERM), ended by `end_children` (asked to stop, then killed) rather
    than killed at once. At `timeout` the child is killed and `subprocess.TimeoutExpired` raised, as
    `subprocess.run` does."""
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with popen(args, **kwargs) as process:
        with ended_on_error([process], grace_s):
            try:
                stdout, stderr = process.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired as expired:
                process.kill()
                stdout, stderr = process.communicate()
                raise subprocess.TimeoutExpired(process.args, expired.timeout, output=stdout, stderr=stderr) from None
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
