"""`python -m bench`'s exit (bench.core.processes): the status, the buffered output, the other threads and atexit's
handlers as `sys.exit` gives them, without the interpreter's teardown; and a reader that went away (`| head`) ends the
command with 141 and no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import atexit, sys, threading, time
from bench.core.processes import exit_without_teardown
atexit.register(lambda: open(sys.argv[1], "w").write("handler ran"))
if sys.argv[2] == "thread":
    threading.Thread(target=lambda: (time.sleep(0.3), open(sys.argv[1] + ".thread", "w").write("done"))).start()
if sys.argv[2] == "worker":  # a process pool's worker standing by, as layer replay's does (its executor's thread)
    import concurrent.futures, multiprocessing, os
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"))
    open(sys.argv[1] + ".worker", "w").write(str(pool.submit(os.getpid).result()))
sys.stdout.write("buffered, no newline")
import os
teardown = os.open(sys.argv[1] + ".teardown", os.O_WRONLY | os.O_CREAT)
class Dropped:
    def __del__(self, write=os.write, fd=teardown):  # bound now: the teardown empties the module's names first
        write(fd, b"torn down")
kept = Dropped()  # freed by the teardown only
exit_without_teardown(3)
"""


def _run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "atexit"), mode], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_the_status_the_output_and_the_atexit_handlers_without_the_teardown(tmp_path):
    done = _run(tmp_path, "alone")
    assert done.returncode == 3 and done.stdout == "buffered, no newline"
    assert (tmp_path / "atexit").read_text() == "handler ran"
    assert (tmp_path / "atexit.teardown").read_text() == ""


def test_another_thread_running_is_waited_for_without_the_teardown(tmp_path):
    done = _run(tmp_path, "thread")
    assert done.returncode == 3 and done.stdout == "buffered, no newline"
    assert (tmp_path / "atexit.thread").read_text() == "done"  # waited for, as the interpreter's exit waits
    assert (tmp_path / "atexit").read_text() == "handler ran"
    assert (tmp_path / "atexit.teardown").read_text() == ""


def test_a_process_pools_worker_standing_by_is_ended_without_the_teardown(tmp_path):
    import os

    done = _run(tmp_path, "worker")
    assert done.returncode == 3 and done.stdout == "buffered, no newline", done.stderr
    assert (tmp_path / "atexit").read_text() == "handler ran"
    assert (tmp_path / "atexit.teardown").read_text() == ""
    worker = int((tmp_path / "atexit.worker").read_text())
    assert not Path(f"/proc/{worker}").exists() or "zombie" in Path(f"/proc/{worker}/status").read_text(), (
        "the pool's worker outlived the command")
    assert os.getpid() != worker


def test_a_reader_that_goes_away_ends_the_command_quietly():
    # `python -m bench list | head -1`: the pipe closed before the command writes, as `head` closes it
    command = subprocess.Popen([sys.executable, "-m", "bench", "list"], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    command.stdout.close()
    errors = command.stderr.read().decode()
    assert command.wait(timeout=60) == 141  # 128 + SIGPIPE, as the shell reports a tool the signal ended
    assert "Traceback" not in errors and "BrokenPipeError" not in errors, errors
