"""Sharded training: one case run as `--ranks N` processes of torch.distributed, launched as torchrun would.

Each rank is a fresh `python -m bench.run._worker` process with torchrun's environment (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT); it joins the process group (gloo on the CPU, NCCL on CUDA, one
GPU a rank) and runs the case's passes as any case runs: verification against single-process training on the
same global batch, timing, memory. Each rank measures its own peak (the exact tracker on the CPU,
`max_memory_allocated` on CUDA). The case's row is rank 0's, with `peak_mem_bytes` and the breakdown of the
largest rank, and `rank_peak_max_bytes` / `rank_peak_min_bytes` across ranks. A rank that fails makes the case
an error row naming it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

from bench.core.processes import ended_on_error, popen
from bench.run.isolation import ROW_MARKER, RunOptions, crash_message, worker_env
from bench.run.result import CaseResult

RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
BREAKDOWN_PREFIX = "peak_"


def in_rank_process() -> bool:
    """True inside a rank launched by `run_on_ranks` (torch.distributed already joined)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def join_process_group(device: str) -> None:
    """Joins the process group torchrun's environment describes (a rank process calls this first)."""
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")


@contextlib.contextmanager
def fake_process_group(ranks: int, rank: int = 0, device: str | None = None) -> Iterator[None]:
    """This process as rank `rank` of `ranks` in PyTorch's fake process group: collectives run and move no data,
    so one process steps through a sharded rank's work and allocations (bench.analysis.predict's per-rank estimate).
    `device="cuda"` makes the group serve CUDA tensors only, as NCCL does: a collective on a host tensor then fails
    as it would under NCCL ("No backend type associated with device type cpu")."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    backend = f"{device}:fake" if device else "fake"
    dist.init_process_group(backend, store=FakeStore(), rank=rank, world_size=ranks)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# a port found free is closed again before rank 0's store listens on it: another process (a second run, a test
# session's other worker) may take it in between, and rank 0 then fails to listen. Such a start is retried on a
# fresh port, a few times; any other failure of a rank is the case's.
PORT_ATTEMPTS = 3


def _port_taken(message: str) -> bool:
    return "EADDRINUSE" in message or "address already in use" in message.lower()


def run_on_ranks(case, env: dict | None, options: RunOptions, verify: bool = True,
                 timeout: float | None = None) -> CaseResult:
    """The case as `options.ranks` processes; the merged result (see the module docstring)."""
    result, port_taken = _launch_ranks(case, env, options, verify, timeout, str(_free_port()))
    for _ in range(PORT_ATTEMPTS - 1):
        if not port_taken:
            break
        result, port_taken = _launch_ranks(case, env, options, verify, timeout, str(_free_port()))
    return result


def _launch_ranks(case, env: dict | None, options: RunOptions, verify: bool, timeout: float | None,
                  port: str) -> tuple[CaseResult, bool]:
    """(the merged result, whether a rank failed because `port` was taken) of one start of the ranks on `port`."""
    ranks = options.ranks
    job = json.dumps({"case": case.to_json(), "env": env, "options": asdict(options), "verify": verify})
    processes, children = [], []
    # the ranks die with this process, and are ended before their folder goes when it stops early (Ctrl-C, SIGTERM)
    with tempfile.TemporaryDirectory(prefix="membench-ranks-") as folder, ended_on_error(children):
        for rank in range(ranks):
            rank_env = {**worker_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks),
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            out, err = (open(Path(folder) / f"{rank}.{kind}", "w") for kind in ("out", "err"))
            process = popen([sys.executable, "-m", "bench.run._worker"], stdin=subprocess.PIPE, stdout=out,
                            stderr=err, text=True, env=rank_env)
            children.append(process)
            process.stdin.write(job)
            process.stdin.close()
            processes.append((process, out, err))
        results = []
        for rank, (process, out, err) in enumerate(processes):
            try:
                code = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                for other, _, _ in processes:
                    other.kill()
                return CaseResult.failed(f"rank {rank} timed out after {timeout:.0f} s"), False
            out.close()
            err.close()
            text = (Path(folder) / f"{rank}.out").read_text()
            result = next((CaseResult.from_json(json.loads(line[len(ROW_MARKER):])) for line in text.splitlines()
                           if line.startswith(ROW_MARKER)), None)
            if code != 0 or result is None:
                for other, _, _ in processes:
                    other.kill()
                stderr = (Path(folder) / f"{rank}.err").read_text()
                message = crash_message(code, stderr)
                return CaseResult.failed(f"rank {rank}: {message}"[:500], ranks=ranks), _port_taken(stderr)
            results.append(result)
    return merge_rank_rows(results), False


def merge_rank_rows(results: list[CaseResult]) -> CaseResult:
    """Rank 0's result, with the largest rank's peak and breakdown and the spread of peaks across ranks (the
    case's one peak is the largest rank's); a rank that did not end ok is the case's result."""
    failed = next((r for r in results if r.row.get("status") != "ok"), None)
    first = failed or results[0]
    merged = CaseResult(first.row.copy(), first.step_times_ms, first.peaks, first.timeline, first.worker_exit_code)
    merged.row["ranks"] = len(results)
    if failed:
        return merged
    peaks = [int(r.row["peak_mem_bytes"]) for r in results]
    largest = results[peaks.index(max(peaks))].row
    merged.row.update({k: v for k, v in largest.items() if k.startswith(BREAKDOWN_PREFIX) and k.endswith("_bytes")})
    merged.row.update(rank_peak_max_bytes=max(peaks), rank_peak_min_bytes=min(peaks))
    merged.peaks = [max(peaks)]
    return merged
