"""Running part of an analysis in the fake-CUDA environment's Python: both sides of the request/rows file protocol.

The caller (`run_in_fake_cuda`) writes a JSON request, runs `python -m <worker module> REQUEST ROWS` there and reads
{"rows": [...]} back, or {"error": "..."} when that process could not do the work; the worker's `main` (`serve`)
imports the plugins, answers, and exits 130 on Ctrl-C, which reaches the caller too. The worker dies with its caller
and is ended (SIGTERM, then SIGKILL) when the caller stops early; SIGTERM and SIGHUP stop it as Ctrl-C does
(bench.core.processes), and the request's temporary folder goes with the caller's `with` block.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

from bench.core import processes
from bench.measure import fake_cuda
from bench.measure.quiet_tracing import quiet_tracing


def run_in_fake_cuda(python: Path, worker_module: str, request: dict[str, Any],
                     whole: bool = False) -> tuple[Any, str]:
    """The worker's rows (with `whole`, its whole answer: {"rows": [...], ...}), and "" ; or None and why it
    failed."""
    with tempfile.TemporaryDirectory(prefix="membench-fake-cuda-") as folder:
        request_file, rows_file = Path(folder) / "request.json", Path(folder) / "rows.json"
        request_file.write_text(json.dumps(request))
        done = processes.run_child([str(python), "-m", worker_module, str(request_file), str(rows_file)],
                                   env=fake_cuda.python_environment(), stdout=subprocess.DEVNULL)
        answer = json.loads(rows_file.read_text()) if rows_file.exists() else {}
    if done.returncode == 0 and "rows" in answer:
        return (answer if whole else answer["rows"]), ""
    return None, answer.get("error") or f"its Python exited with code {done.returncode}"


def serve(request_path: str, rows_path: str, answer: Callable[[dict[str, Any]], list[dict] | dict]) -> int:
    """The worker's side: `answer(request)` gives the rows (or a dict with "rows" and more); the exit status the
    caller reads."""
    from bench.run._worker import import_plugins

    processes.stop_on_signals()  # SIGTERM from a caller that stops early: this process's cleanup runs
    quiet_tracing()  # as the CLI: library messages about membench's own hooks do not reach the caller's terminal
    try:
        import_plugins()
        rows = answer(json.loads(Path(request_path).read_text()))
    except KeyboardInterrupt:  # Ctrl-C reaches the caller too, which says what was interrupted
        return 130
    except Exception as error:  # noqa: BLE001 - the caller does the work in its own process instead, saying why
        Path(rows_path).write_text(json.dumps({"error": f"{type(error).__name__}: {error}".splitlines()[0]}))
        return 1
    Path(rows_path).write_text(json.dumps(rows if isinstance(rows, dict) else {"rows": rows}))
    return 0
