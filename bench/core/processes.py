"""Processes that end with the one that started them: signals that stop a command run its cleanup, and children die
with their parent.

SIGINT raises KeyboardInterrupt in Python; SIGTERM (what `timeout`, a scheduler's time limit and a container stop
send) and SIGHUP (a closed terminal) end the process at once by default, so no `finally` runs: worker processes go
on without their parent and temporary files and folders stay. `stop_on_signals()` makes the three alike. The first
raises an exception in the main thread (KeyboardInterrupt for SIGINT, `Terminated` for the others), so every `with`
block unwinds (worker pools ended, temporary folders removed, atomic writes' temporaries deleted), and sends SIGTERM
to each child `popen` started that still runs (also one that another thread waits on). Later ones are ignored while
that cleanup runs; a stop that Python swallowed (raised in an at-fork callback) is raised again, and a process still
running STOP_LIMIT_S after the first signal is ended there.

A child started with `popen` or `run_child` gets SIGTERM from Linux when its parent ends, however it ends (SIGKILL
included), and is sent SIGTERM, then SIGKILL after a grace period, when its parent stops waiting for it because of
an exception (`end_children`).

Example:
    stop_on_signals()                      # first thing in a process's entry point
    done = run_child([sys.executable, "-m", "some.worker"], input=job, capture_output=True, text=True)
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterator, NoReturn

PR_SET_PDEATHSIG = 1  # linux/prctl.h
TERMINATING = (signal.SIGTERM, signal.SIGHUP)
STOPPING = (signal.SIGINT, *TERMINATING)
GRACE_S = 10.0  # how long a child that was asked to stop may clean up before it is killed
# how long a stopping process may take to end: an exception raised into code with a bare `except:` (a library's
# import) is swallowed and the process would run on, deaf to the signals that follow; it is ended then
STOP_LIMIT_S = 3 * GRACE_S
RAISE_AGAIN_S = 0.1  # a stop that Python swallowed is raised again this long after, once the callback has returned


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


def stopped_by(error: BaseException) -> KeyboardInterrupt | None:
    """The interrupt behind `error`, if it was raised while one unwound (a cleanup that failed: an import the signal
    had cut half-way, imported again); None for an error of its own."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return error
        seen.add(id(error))
        error = error.__context__
    return None


# the signal being handled (None: none yet), and whether the deadline of STOP_LIMIT_S is set
_stopping: dict[str, Any] = {"signal": None, "deadline": False}


# the children `popen` started that may still run: told to stop with their parent, also those another thread waits on
_children: "weakref.WeakSet[subprocess.Popen]" = weakref.WeakSet()


def _stop(signum: int, frame: Any) -> None:
    if _stopping["signal"] is not None:
        return  # the cleanup of the first signal is under way: it ends the process
    _stopping["signal"] = signum
    for child in list(_children):  # a signal sent to this process alone (kill PID, a container stop) reaches them
        with contextlib.suppress(OSError):
            child.send_signal(signal.SIGTERM)
    if not _stopping["deadline"]:
        _stopping["deadline"] = True
        deadline = threading.Timer(STOP_LIMIT_S, _end_now, (signum,))
        deadline.daemon = True  # a process that ends in time does not wait for it
        deadline.start()
    raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)


def _raised_again(unraisable: Any) -> None:
    """sys.unraisablehook: a stop raised where Python only prints an exception and goes on (an at-fork callback of a
    pool's fork, a `__del__`) is raised again in the main thread a moment later (not in this hook, where it would be
    swallowed again), instead of being lost."""
    signum = _stopping["signal"]
    if isinstance(unraisable.exc_value, KeyboardInterrupt) and signum is not None:
        _stopping["signal"] = None  # `_stop` raises it again
        # the signal itself, to the main thread: a wait there (sleep, a lock, a pipe) is interrupted as by the first
        again = threading.Timer(RAISE_AGAIN_S, signal.pthread_kill, (threading.main_thread().ident, signum))
        again.daemon = True
        again.start()
        return
    _hooks["unraisable"](unraisable)


_hooks: dict[str, Any] = {"unraisable": sys.unraisablehook}


def _end_now(signum: int) -> None:
    """The process did not end within STOP_LIMIT_S of the signal: its children killed, it exits 128 + signum."""
    for child in list(_children):
        with contextlib.suppress(OSError):
            child.kill()
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"\nstopping took over {STOP_LIMIT_S:g} s after {signal.Signals(signum).name} (its exception "
                         "was caught somewhere): ended now\n")
        sys.stderr.flush()
    os._exit(128 + signum)


def stop_on_signals() -> None:
    """SIGINT, SIGTERM and SIGHUP raise KeyboardInterrupt / `Terminated` in the main thread, once (see above). A
    signal this process ignores (SIGHUP under nohup) stays ignored. Only in the main thread of a process's entry
    point: a library must not take over its host's signals."""
    _stopping.update(signal=None, deadline=False)
    for signum in STOPPING:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _stop)
    if sys.unraisablehook is not _raised_again:
        _hooks["unraisable"] = sys.unraisablehook
        sys.unraisablehook = _raised_again


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
    child = subprocess.Popen(args, preexec_fn=_child_setup(os.getpid(), preexec_fn), **kwargs)
    _children.add(child)
    return child


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


def exit_without_teardown(status: int | None) -> NoReturn:
    """Ends this process with `status` as `sys.exit` does, less the interpreter's teardown: the standard streams
    flushed, the other threads waited for and atexit's handlers run (multiprocessing's, logging's, temporary
    folders' finalizers, a coverage run's save), in the interpreter's order, then `os._exit`. The teardown freed every
    object of torch's and transformers' imports one by one: 0.9 s of the 3.0 s of a `predict` of the captcha ResNet,
    where nothing was left to write, and 1.0 s of an 8B prediction's 6.5 s whose layer replay's worker stood by (its
    executor's thread is another thread). A status that is not a number: `sys.exit`'s own exit. For a program's
    entry point only (`python -m bench`), never for a function called in-process."""
    if not (status is None or isinstance(status, int)):
        sys.exit(status)
    _flushed()
    # what the interpreter's exit does first (private to CPython, there since Python 3.4 and 2): join the threads
    # that are not daemons, after the hooks threads registered (concurrent.futures' executors end their workers)
    threading._shutdown()
    atexit._run_exitfuncs()
    _flushed()
    os._exit(status or 0)


def output_closed_status() -> int:
    """The exit status of a command whose reader went away (`| head`: a write raised BrokenPipeError), its standard
    output pointed at /dev/null so that nothing writes to the closed pipe again: 141, 128 + SIGPIPE, as the shell
    reports a Unix tool that the signal ended (Python ignores SIGPIPE, so the write raises instead)."""
    with contextlib.suppress(Exception):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def _flushed() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe (`| head`): what the teardown would ignore too
            stream.flush()
