"""Entry point for `python -m bench`."""

import sys

from bench.core.processes import stop_on_signals

# SIGTERM (timeout, a scheduler, a container stop) and SIGHUP stop a command as Ctrl-C does: its worker processes are
# ended and its temporary files and folders removed, then it exits 143 / 129 (bench.core.processes)
stop_on_signals()

from bench.cli.main import main  # noqa: E402 - the signals are ours before the import's seconds

sys.exit(main())
