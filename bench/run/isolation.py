"""Keeping one case's process-wide state out of the next: a state guard in-process, or a fresh worker process.

In-process (`isolate=False`) every case runs inside `process_state()`, which sets the thread count and the
determinism flags the run asked for and, on exit, restores every process-wide torch flag a strategy or a user's workload might
flip (cuDNN benchmark/deterministic/enabled/TF32, deterministic algorithms, float32 matmul precision, grad
mode, thread count, default dtype and device, anomaly mode, the attention kernels, the CPU generator), so that
even code that forgets to restore a flag cannot change the next case.
What the guard cannot undo: the CUDA caching allocator's pool, cuDNN's autotuner cache, autocast caches, and
anything a strategy builds in C++. Hence `isolate=True` (the default on CUDA): each case -- and each repeat --
runs in a fresh `python -m bench.run._worker` process, which gets the case as JSON on stdin and prints its result
(row and side data, `bench.run.result.CaseResult`) as JSON on stdout. A worker that dies (non-zero exit, a signal,
no row) becomes an `error` row naming the exit code and the last line of its stderr, and the sweep goes on.
A worker still running at the case's deadline (`RunOptions.case_timeout_s`) is killed: the case is a `timeout` row
naming the stage it was in (the worker reports each stage on stderr), and the sweep goes on. A model that never
returns cannot be stopped safely inside this process, hence the limit exists for isolated cases only.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import torch

from bench.core import processes
from bench.core.job_environment import without_launcher_variables
from bench.core.results import Status, new_row
from bench.run.result import CaseResult

ROOT = Path(__file__).resolve().parents[2]
ROW_MARKER = "MEMBENCH_ROW "
STAGE_MARKER = "MEMBENCH_STAGE "  # a worker's stderr line when a case enters a stage (verification, timing, ...)


@dataclass(frozen=True)
class RunOptions:
    """How the cases of a run are measured (the same for every case, recorded in every row).

    threads: `torch.set_num_threads` for each case; None = torch's default in this process (usually the number
    of physical cores), resolved once by `resolved()` so isolated workers use the same number.
    """

    isolate: bool = False
    repeats: int = 1
    threads: int | None = None
    deterministic: bool = False
    executor: str = "local"  # where the cases ran: `local` (here) or `ray` (bench.run.ray_executor)
    ranks: int = 1  # processes of torch.distributed for a sharded strategy's case (bench.run.ranks)
    # `--memory-limit` as a fraction of the GPU's memory (torch.cuda.set_per_process_memory_fraction): a limit
    # of the process that set it, so each worker process sets it again (bench.run._worker)
    memory_fraction: float | None = None
    # `--case-timeout`: wall-clock seconds a case (all its repeats) may take before its worker is killed and its row
    # says `timeout`; None for no limit. Only isolated cases can be stopped (bench.run.runner.run_case_isolated).
    case_timeout_s: float | None = None
    # `--snapshot`: the folder where each case's memory snapshot of its measured step is written
    # (bench.run.runner.save_snapshot), by whichever process measures it; None for none
    snapshot_dir: str | None = None

    def resolved(self) -> "RunOptions":
        return replace(self, threads=self.threads or torch.get_num_threads())


# The scaled-dot-product-attention kernels a user's code may switch off (each changes the step's memory)
_SDP_KERNELS = ("flash", "mem_efficient", "math", "cudnn")


def _flags() -> dict[str, Any]:
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    sdp = {f"sdp.{kernel}": getattr(torch.backends.cuda, f"{kernel}_sdp_enabled")() for kernel in _SDP_KERNELS
           if hasattr(torch.backends.cuda, f"{kernel}_sdp_enabled")}
    return {**sdp,
        # what a user's workload may set globally and forget (torch.set_default_dtype in build_model): the next
        # case would run in float64 with status ok
        "default_dtype": torch.get_default_dtype(), "default_device": _default_device_set(),
        "anomaly": torch.is_anomaly_enabled(), "anomaly_check_nan": torch.is_anomaly_check_nan_enabled(),
        "rng": _RngState(torch.get_rng_state()),
        "matmul.fp16_reduction": matmul.allow_fp16_reduced_precision_reduction,
        "matmul.bf16_reduction": matmul.allow_bf16_reduced_precision_reduction,
        "cudnn.benchmark": cudnn.benchmark, "cudnn.deterministic": cudnn.deterministic,
        "cudnn.enabled": cudnn.enabled, "cudnn.allow_tf32": cudnn.allow_tf32, "matmul.allow_tf32": matmul.allow_tf32,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "grad_enabled": torch.is_grad_enabled(), "threads": torch.get_num_threads(),
    }


class _RngState:
    """The CPU generator's state, equal to another by its bytes (a tensor's == is elementwise, so two flag dicts
    holding it could not be compared)."""

    def __init__(self, state: torch.Tensor):
        self.state = state

    def __eq__(self, other) -> bool:
        return isinstance(other, _RngState) and torch.equal(self.state, other.state)

    __hash__ = None


def _default_device_set():
    """The device torch.set_default_device set (None where none is: then no device mode intercepts every call)."""
    context = getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)
    return None if context is None else context.device


def _restore(flags: dict[str, Any]) -> None:
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    cudnn.benchmark, cudnn.deterministic = flags["cudnn.benchmark"], flags["cudnn.deterministic"]
    cudnn.enabled, cudnn.allow_tf32 = flags["cudnn.enabled"], flags["cudnn.allow_tf32"]
    matmul.allow_tf32 = flags["matmul.allow_tf32"]
    torch.use_deterministic_algorithms(flags["deterministic_algorithms"], warn_only=flags["deterministic_warn_only"])
    torch.set_float32_matmul_precision(flags["float32_matmul_precision"])
    torch.set_grad_enabled(flags["grad_enabled"])
    if torch.get_num_threads() != flags["threads"]:
        torch.set_num_threads(flags["threads"])
    torch.set_default_dtype(flags["default_dtype"])
    if _default_device_set() != flags["default_device"]:
        torch.set_default_device(flags["default_device"])
    torch.autograd.set_detect_anomaly(flags["anomaly"], check_nan=flags["anomaly_check_nan"])
    torch.set_rng_state(flags["rng"].state)
    matmul.allow_fp16_reduced_precision_reduction = flags["matmul.fp16_reduction"]
    matmul.allow_bf16_reduced_precision_reduction = flags["matmul.bf16_reduction"]
    for kernel in _SDP_KERNELS:
        if f"sdp.{kernel}" in flags:
            getattr(torch.backends.cuda, f"enable_{kernel}_sdp")(flags[f"sdp.{kernel}"])


@contextlib.contextmanager
def process_state(threads: int | None = None, deterministic: bool = False) -> Iterator[None]:
    """Sets threads and determinism for one case; restores every process-wide flag of `_flags()` on exit."""
    saved = _flags()
    try:
        if threads:
            torch.set_num_threads(threads)
        if deterministic:
            torch.backends.cudnn.deterministic = True
            torch.use_deterministic_algorithms(True)
        yield
    finally:
        _restore(saved)


def worker_env() -> dict[str, str]:
    """The environment of a worker process (isolated case, Ray-less rank): this one's, with the checkout importable
    and without a job launcher's rendezvous variables (bench.core.job_environment)."""
    env = without_launcher_variables(os.environ)  # a torchrun/SLURM shell's RANK, WORLD_SIZE: not this worker's
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    if "CUBLAS_WORKSPACE_CONFIG" not in env:
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # needed by use_deterministic_algorithms on CUDA >= 10.2
    return env


def crash_message(returncode: int, stderr: str) -> str:
    """What a worker that died says in its row: how it ended, and the last line of its stderr that is not one of
    membench's own stage markers (the stage it was in where it printed nothing else). A worker that exits 0 without
    a row was ended by the workload's own code (`os._exit`, `sys.exit` in a thread): the row says so."""
    if returncode < 0:
        try:
            how = f"killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"killed by signal {-returncode}"
    else:
        how = f"exit code {returncode}"
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    last = next((line for line in reversed(lines) if not line.startswith(STAGE_MARKER)), "")
    if returncode == 0:
        return (f"the workload's code exited (exit code 0, os._exit or sys.exit) during {last_stage(stderr)}, "
                "before the case had a result" + (f": {last}" if last else ""))[:500]
    if not last and lines:
        last = f"during {last_stage(stderr)}"
    return (f"worker crashed ({how})" + (f": {last}" if last else ""))[:500]


def last_stage(stderr: str | bytes | None) -> str:
    """The stage a worker last reported on its stderr (`STAGE_MARKER` lines), or `setup` before any."""
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr or ""
    stages = [line[len(STAGE_MARKER):].strip() for line in text.splitlines() if line.startswith(STAGE_MARKER)]
    return stages[-1] if stages else "setup (building the model and batch)"


def timed_out(limit_s: float, stderr: str | bytes | None) -> CaseResult:
    """The `timeout` result of a case whose worker was killed at its deadline, `limit_s` after the case began."""
    message = (f"the case did not finish within --case-timeout {limit_s:g} s; its worker was killed "
               f"during {last_stage(stderr)}")
    return CaseResult(new_row(status=Status.TIMEOUT.value, message=message))


def run_in_worker(case, env: dict | None, options: RunOptions, verify: bool = True,
                  timeout: float | None = None) -> CaseResult:
    """Runs `measure_case(case, env, options, verify_result=verify)` (one repeat) in a fresh Python process; returns
    its result.

    A worker that crashes returns an error result (`worker_exit_code` holds its exit code, negative for a signal).
    A worker still running after `timeout` seconds is killed and returns a `timeout` result (see `timed_out`).
    A worker ended by SIGINT (Ctrl-C reaching the process group) raises KeyboardInterrupt here, so that an
    interrupted case leaves no row and `--resume` runs it again. The worker dies with this process, and is asked
    to stop (then killed) when this one stops waiting for it: Ctrl-C, SIGTERM, SIGHUP (bench.core.processes).
    """
    job = {"case": case.to_json(), "env": env, "options": asdict(options), "verify": verify}
    try:
        done = processes.run_child([sys.executable, "-m", "bench.run._worker"], input=json.dumps(job), text=True,
                                   capture_output=True, env=worker_env(), timeout=timeout)
    except subprocess.TimeoutExpired as error:  # run_child has killed the worker and waited for it
        return timed_out(options.case_timeout_s or error.timeout, error.stderr)
    if done.returncode in (-signal.SIGINT, 130):
        raise KeyboardInterrupt
    result = None
    for line in done.stdout.splitlines():
        if line.startswith(ROW_MARKER):
            result = CaseResult.from_json(json.loads(line[len(ROW_MARKER):]))
    if done.returncode != 0 or result is None:
        return CaseResult.failed(crash_message(done.returncode, done.stderr), done.returncode)
    return result
