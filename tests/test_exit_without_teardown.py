"""`python -m bench`'s exit (bench.core.processes): the status, the buffered output and atexit's handlers as `sys.exit`
gives them, without the interpreter's teardown (with another thread running, `sys.exit`); and a reader that went away
(`| head`) ends the command with 141 and no traceback."""

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
sys.stdout.write("buffered, no newline")
class Dropped:
    def __del__(self):
        open(sys.argv[1] + ".teardown", "w").write("torn down")
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
    assert not (tmp_path / "atexit.teardown").exists()


def test_another_thread_running_gets_the_usual_exit(tmp_path):
    done = _run(tmp_path, "thread")
    assert done.returncode == 3 and done.stdout == "buffered, no newline"
    assert (tmp_path / "atexit.thread").read_text() == "done"  # the teardown waited for it
    assert (tmp_path / "atexit").read_text() == "handler ran"


def test_a_reader_that_goes_away_ends_the_command_quietly():
    # `python -m bench list | head -1`: the pipe closed before the command writes, as `head` closes it
    command = subprocess.Popen([sys.executable, "-m", "bench", "list"], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    command.stdout.close()
    errors = command.stderr.read().decode()
    assert command.wait(timeout=60) == 141  # 128 + SIGPIPE, as the shell reports a tool the signal ended
    assert "Traceback" not in errors and "BrokenPipeError" not in errors, errors
