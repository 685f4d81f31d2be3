"""SIGINT, SIGTERM and SIGHUP (Ctrl-C; `timeout`, a scheduler's limit, a container stop; a closed terminal) stop a
command alike: every worker process it started ends with it and no temporary file or folder outlives it. The CLI
runs as a real process with TMPDIR in the test's folder; the signal goes to that process alone, as `kill` sends it.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from cli_helpers import ROOT

# a workload whose every forward sleeps $MEMBENCH_TEST_SLEEP_S: its probes and steps last while the signal is sent
SLEEPY = (Path(__file__).parent / "fixtures" / "sleepy_workload.py").read_text()

SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]


def _signals_as_in_a_terminal() -> None:
    """In the child before it execs: the signals' default actions (a shell runs a background job, `make test &`,
    with SIGINT ignored, and `nohup` SIGHUP; children inherit that)."""
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def _start(args: list, tmp_path: Path, sleep_s: float, **variables: str) -> tuple[subprocess.Popen, Path]:
    """`python -m bench ARGS` with its temporary folder (TMPDIR) empty in `tmp_path` (torch's compile caches, which
    are meant to outlive a process, elsewhere) and the environment `variables` set."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {**os.environ, "TMPDIR": str(temporary), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "TRITON_CACHE_DIR": str(tmp_path / "triton"), "MEMBENCH_TEST_SLEEP_S": str(sleep_s), **variables}
    proc = subprocess.Popen([sys.executable, "-m", "bench", *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_signals_as_in_a_terminal)
    return proc, temporary


def _command_line(process: psutil.Process) -> str:
    """The process's command line; "" for one that has ended or is a zombie not yet reaped (a short-lived child, such
    as a probe of the machine, can be either between listing and reading)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def _outlived(processes: list) -> list:
    """Those of `processes` still running (a zombie has ended, its parent not yet reaped it)."""
    alive = []
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{process.pid} {_command_line(process)[:200]}")
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_for(condition, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"the command ended before the signal: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, "the command never reached the state the signal is sent in"
        time.sleep(0.05)


def _stop_and_check(proc: subprocess.Popen, signum: int, temporary: Path, workers: bool = True) -> str:
    """Sends `signum` to the command alone; asserts it exits 128 + signum, that none of the processes it had started
    survives it, and that its temporary folder is empty. Returns its stderr."""
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children or not workers, "the command had started no worker process"
    proc.send_signal(signum)
    try:
        _, stderr = proc.communicate(timeout=60)
        _, alive = psutil.wait_procs(children, timeout=15)
        survivors = _outlived(alive)
        assert not survivors, f"{signal.Signals(signum).name}: these outlived the command: {survivors}"
        assert proc.returncode == 128 + signum, stderr[-2000:]
        assert sorted(p.name for p in temporary.iterdir()) == [], stderr[-2000:]
        return stderr
    finally:
        for child in children:  # a failed test leaves nothing running either
            if child.is_running():
                child.kill()
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_parallel_fit_ends_its_workers_on_each_signal(tmp_path, signum):
    """`fit --jobs 2`: its probes run in two worker processes; each signal ends them with the command."""
    workload = tmp_path / "sleepy.py"
    workload.write_text(SLEEPY)
    proc, temporary = _start(["fit", "--device", "cpu", "--budget", "1GiB", "--jobs", "2", "--workload",
                              f"{workload}:SleepyWorkload", "--max-batch", "4096", "--out", tmp_path / "out"],
                             tmp_path, sleep_s=30)
    _wait_for(lambda: len(psutil.Process(proc.pid).children(recursive=True)) >= 2, proc)
    stderr = _stop_and_check(proc, signum, temporary)
    assert "interrupted: nothing was written" in stderr, stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.csv"))


# SIGTERM in `make test`; the other two, which take the same path through the ranks' code, with --runslow (15 s each)
@pytest.mark.parametrize("signum", [pytest.param(s, marks=[] if s == signal.SIGTERM else [pytest.mark.slow])
                                    for s in SIGNALS], ids=lambda s: signal.Signals(s).name)
def test_a_sharded_run_ends_its_ranks_and_removes_their_folder(tmp_path, signum):
    """`run --ranks 2`: two rank processes, their output in a temporary folder; each signal ends both and removes
    the folder."""
    workload = tmp_path / "sleepy.py"
    workload.write_text(SLEEPY)
    proc, temporary = _start(["run", "--strategies", "ddp", "--ranks", "2", "--workload",
                              f"{workload}:SleepyWorkload", "--phases", "train", "--device", "cpu", "--warmup", "0",
                              "--steps", "1", "--threads", "1", "--no-isolate", "--out", tmp_path / "out"],
                             tmp_path, sleep_s=30, MEMBENCH_TEST_SLEEP_IN_RANKS_ONLY="1")

    def ranks_running() -> bool:
        ranks = [p for p in psutil.Process(proc.pid).children() if "bench.run._worker" in _command_line(p)]
        return len(ranks) == 2 and any(p.name.startswith("membench-ranks-") for p in temporary.iterdir())

    _wait_for(ranks_running, proc)
    _stop_and_check(proc, signum, temporary)


def test_workers_die_with_a_parent_killed_outright(tmp_path):
    """SIGKILL, which no cleanup can catch (the out-of-memory killer's): Linux ends the workers (PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the parent-death signal is Linux's")
    workload = tmp_path / "sleepy.py"
    workload.write_text(SLEEPY)
    proc, _ = _start(["fit", "--device", "cpu", "--budget", "1GiB", "--jobs", "2", "--workload",
                      f"{workload}:SleepyWorkload", "--max-batch", "4096", "--out", tmp_path / "out"],
                     tmp_path, sleep_s=30)
    _wait_for(lambda: len(psutil.Process(proc.pid).children(recursive=True)) >= 2, proc)
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()
    proc.communicate(timeout=60)
    try:
        _, alive = psutil.wait_procs(children, timeout=15)
        assert not _outlived(alive)
    finally:
        for child in children:
            if child.is_running():
                child.kill()


def test_a_rank_search_stopped_before_its_first_count_names_no_file(tmp_path):
    """`plan --max-ranks` writes its CSV after each rank count: stopped during the first, it says that none was
    finished and names no file (it named one that did not exist)."""
    workload = tmp_path / "sleepy.py"
    workload.write_text(SLEEPY)
    out = tmp_path / "out"
    proc, temporary = _start(["plan", "--device", "cpu", "--budget", "1KiB", "--max-ranks", "4", "--workload",
                              f"{workload}:SleepyWorkload", "--out", out], tmp_path, sleep_s=30)
    seen = ""
    deadline = time.monotonic() + 120
    while "baseline ..." not in seen and time.monotonic() < deadline and proc.poll() is None:
        seen += proc.stderr.readline()
    # in the baseline's forward, which sleeps: not in an import, which a signal would cut half-way (that stop is
    # still a stop, `bench/__main__.py`, but the cleanup then has an import error to report as well)
    _wait_for(lambda: psutil.Process(proc.pid).cpu_percent(interval=0.5) < 10, proc)
    stderr = _stop_and_check(proc, signal.SIGINT, temporary, workers=False)  # the baseline runs in the command
    assert "interrupted: no rank count was finished, nothing was written" in stderr
    assert str(out) not in stderr and not list(out.glob("*.csv"))


def _script(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    """`body` run after `stop_on_signals()` in a fresh Python (no torch: a fraction of a second)."""
    script = tmp_path / "script.py"
    script.write_text("import os, signal, sys, time\nfrom bench.core import processes\nprocesses.stop_on_signals()\n"
                      + textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=60, preexec_fn=_signals_as_in_a_terminal)


def test_a_stop_that_python_swallowed_in_an_at_fork_callback_is_raised_again(tmp_path):
    """A signal that lands in an at-fork callback (a pool forking its workers) is printed and ignored by Python:
    it is raised again, and the process stops."""
    done = _script(tmp_path, """
        os.register_at_fork(after_in_parent=lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(0.2)))
        try:
            if os.fork() == 0:
                os._exit(0)
            time.sleep(20)
            print("ran on")
        except processes.Terminated:
            print("stopped")
    """)
    assert done.stdout.strip() == "stopped", done.stderr[-2000:]


def test_a_stop_that_code_swallows_ends_the_process_at_the_limit(tmp_path):
    """A bare `except:` that swallows the stop (and goes on, deaf to later signals): the process ends
    STOP_LIMIT_S after the signal, exit 143, saying why."""
    done = _script(tmp_path, """
        processes.STOP_LIMIT_S = 1.0
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except BaseException:
            pass
        os.kill(os.getpid(), signal.SIGTERM)  # ignored: the stop is under way
        time.sleep(20)
        print("ran on")
    """)
    assert done.returncode == 143 and "ran on" not in done.stdout
    assert "stopping took over 1 s after SIGTERM" in done.stderr
