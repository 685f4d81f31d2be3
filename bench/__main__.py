"""Entry point for `python -m bench`."""

import sys

from bench.core.processes import (exit_status, exit_without_teardown, output_closed_status, stop_on_signals,
                                  stopped_by)

# SIGTERM (timeout, a scheduler, a container stop) and SIGHUP stop a command as Ctrl-C does: its worker processes are
# ended and its temporary files and folders removed, then it exits 143 / 129 (bench.core.processes)
stop_on_signals()

from bench.cli import interrupt  # noqa: E402 - the signals are ours before the imports' seconds
from bench.cli.main import main  # noqa: E402

try:
    status = main(may_hand_over=True)
except BrokenPipeError:  # the reader of the output went away (`| head`): no traceback, as a Unix tool
    status = output_closed_status()
except Exception as error:
    stopped = stopped_by(error)  # a cleanup that failed while a signal stopped the command: still that signal's stop
    if stopped is None:
        raise
    print(f"\n{interrupt.note()}", file=sys.stderr)
    status = exit_status(stopped)
exit_without_teardown(status)
