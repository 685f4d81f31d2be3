"""Sweeps on a Ray cluster: every case, and every repeat of a case, as a Ray task in a fresh worker process; and
`RayPool`, the same for each candidate of `plan` and each probe of `fit` (`bench.analysis.pools`).

`python -m bench compare ... --executor ray [--ray-address ADDRESS]`. Without an address a local Ray is started
for the sweep, bound to 127.0.0.1, and stopped after it; with one (`auto`, `ray://head:10001`, `head:6379`) the
sweep runs on that cluster. Each task runs `bench.run._worker.run_job` (the body of an `--isolate` worker) in a
worker process that is never reused (`max_calls=1`), so one case cannot disturb the next, and is never retried
(`max_retries=0`): a worker that dies (out of host memory, a killed node) becomes an `error` row that says so,
and the sweep goes on. A CUDA case asks for a whole GPU, a CPU case for `--threads` CPUs.

The workers get membench's code as the job's working directory (a Ray runtime environment: nothing is installed
by hand on them) and the source of any workload given as `file.py:NAME`; on a remote cluster they also get
membench's pure-Python dependencies by pip. PyTorch itself must be on the nodes (the cluster's image).
The driver receives rows as tasks finish and the runner writes them as always: atomically, each at once.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import socket
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

from bench.core.errors import UsageError
from bench.core.job_environment import CACHE_VARIABLE, PLUGINS_VARIABLE
from bench.run._worker import run_job
from bench.run.isolation import ROOT, RunOptions
from bench.run.result import CaseResult
from bench.run.case import Case
from bench.run.runner import pool_repeats, with_base_row
from workloads.framework.loader import file_reference

INSTALL_HINT = "pip install 'membench[ray]' (in a checkout: make install)"
# what the workers do not need of the checkout (the runtime environment uploads the rest)
EXCLUDES = [".git", ".venv", "results", "*.png", "*.pt", ".pytest_cache", ".benchmarks", "__pycache__", "build",
            "*.egg-info"]
REMOTE_PIP = ["pandas", "pyyaml", "captcha", "pillow"]  # membench's dependencies besides torch


def import_ray():
    """The ray module, or a one-line UsageError saying how to install it."""
    try:
        import ray
    except ModuleNotFoundError:
        raise UsageError(f"--executor ray needs the ray package, not installed: {INSTALL_HINT}") from None
    return ray


ADDRESS_FORMS = ("auto (the cluster this machine belongs to), host:port (a head node's GCS, port 6379), "
                 "ray://host:port (the Ray client, port 10001)")
CLIENT_HINT = "pip install 'ray[client]'"
CONNECT_TIMEOUT_S = 5.0  # the most a sweep waits to find out that its cluster cannot be reached
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*):([0-9]{1,5})")


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of `host:port` or `ray://host:port` (an IPv6 host in brackets), None for any other text."""
    match = _HOST_PORT.fullmatch(address.removeprefix("ray://"))
    if not match or not 0 < int(match.group(2)) < 65536:
        return None
    return match.group(1).strip("[]"), int(match.group(2))


def check_address(address: str, option: str = "--ray-address") -> None:
    """A one-line UsageError unless `address` has one of the forms Ray takes (ADDRESS_FORMS) and, for `ray://`, the
    Ray client's package is installed: checked before anything starts, instead of Ray's traceback after 30 s."""
    if address == "auto":
        return
    if _host_port(address) is None:
        raise UsageError(f"{option} {address!r} is not a Ray address; valid forms: {ADDRESS_FORMS}")
    if address.startswith("ray://") and importlib.util.find_spec("grpc") is None:
        raise UsageError(f"{option} {address}: the Ray client (ray://) needs ray[client], not installed: {CLIENT_HINT}")


def probe_address(address: str, option: str = "--ray-address", timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """A one-line UsageError when nothing answers at `address`'s host and port within `timeout_s` (a typo in the
    host, a head that is down), instead of Ray's retries; `auto` is left to Ray, which fails at once without a
    cluster. Limitations: it only opens a TCP connection, so a port that answers but is not Ray's passes."""
    where = _host_port(address)
    if where is None:
        return
    try:
        socket.create_connection(where, timeout=timeout_s).close()
    except OSError as error:
        reason = "no answer" if isinstance(error, TimeoutError) else (error.strerror or str(error))
        raise UsageError(f"{option} {address}: cannot reach {where[0]}:{where[1]} within {timeout_s:g} s ({reason}); "
                         "is the Ray head running there?") from None


def workload_files(cases: list[Case]) -> dict[str, str]:
    """The source of every workload file the cases name (`file.py:NAME`), by the path the spec gives."""
    files = {}
    for case in cases:
        path = file_reference(case.workload)
        if path and path not in files:
            files[path] = Path(path).read_text(encoding="utf-8")
    return files


def runtime_env(remote: bool) -> dict:
    """The workers' environment: membench's code, the data cache setting, and on a remote cluster its deps."""
    env = {"working_dir": str(ROOT), "excludes": EXCLUDES}
    passed = {k: os.environ[k] for k in (CACHE_VARIABLE, PLUGINS_VARIABLE) if k in os.environ}
    if passed:
        env["env_vars"] = passed
    if remote:
        env["pip"] = REMOTE_PIP
    return env


def connect(ray, address: str | None, threads: int = 1) -> bool:
    """Connects to the cluster at `address`, or starts a local one bound to 127.0.0.1 with this machine's cores (at
    least `threads`); True when this call started or joined it (and must shut it down), False when this process
    was already connected (a test's Ray, left running)."""
    if ray.is_initialized():
        return False
    common = dict(runtime_env=runtime_env(remote=address is not None), include_dashboard=False,
                  log_to_driver=False, logging_level=logging.WARNING)  # the progress lines are ours
    if address:
        try:
            ray.init(address=address, **common)
        except (ConnectionError, RuntimeError) as error:  # a probe passed, yet Ray could not connect
            first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
            raise UsageError(f"cannot connect to the Ray cluster at {address}: {first.strip()}") from None
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, threads), _node_ip_address="127.0.0.1", **common)
    return True


def checked_address(address: str | None) -> str | None:
    """`--ray-address` (or, without it, `$RAY_ADDRESS`, which ray.init() reads) checked before anything starts: its
    form, the ray package, then that something answers there; a one-line UsageError for each. The address given."""
    checked = address or os.environ.get("RAY_ADDRESS", "").strip()
    option = "--ray-address" if address else "$RAY_ADDRESS"
    if checked:
        check_address(checked, option)  # its form first: a typo is named before Ray is even imported
    import_ray()  # a missing package is an error before anything runs
    if checked:
        probe_address(checked, option)  # seconds, not Ray's retries, to learn that nothing answers there
    return address


def _call_in_worker(files: dict[str, str], function, *args):
    """A RayPool task: `function(*args)` with the plugins imported, the user's workload files shipped (`files`: a
    path as the spec names it -> its source) and one thread (fake tensors do no arithmetic; a probe or candidate
    uses one CPU of the cluster, as it asked)."""
    import torch

    from bench.run._worker import import_plugins
    from workloads.framework.loader import ship_file

    import_plugins()
    for path, source in files.items():
        ship_file(path, source)
    torch.set_num_threads(1)
    return function(*args)


class RayPool:
    """Calls as Ray tasks, with the interface of `concurrent.futures`' executors that `bench.analysis.pools`
    describes: each call a task in a fresh worker process (`max_calls=1`, as compare's cases), one CPU each, never
    retried (`max_retries=0`: a worker that dies is an error the search turns into a row). The workers get
    membench's code by the runtime environment compare's tasks get (`runtime_env`), and the source of each workload
    of `workloads` given as `file.py:NAME`, as compare's cases do. `slots`: `jobs`, else the
    cluster's CPUs; Ray queues what it cannot start at once, so the search submits no more than that."""

    def __init__(self, address: str | None = None, jobs: int | None = None, workloads: tuple[str, ...] = ()):
        self.files = {path: Path(path).read_text(encoding="utf-8")
                      for path in dict.fromkeys(filter(None, map(file_reference, workloads)))}
        self.ray = import_ray()
        self.started = connect(self.ray, address)
        cpus = int(self.ray.cluster_resources().get("CPU", 0))
        if cpus < 1:
            self.shutdown()
            raise UsageError(f"--executor ray: the Ray cluster{f' at {address}' if address else ''} has no CPU")
        self.slots = jobs or cpus
        self.lost = (self.ray.exceptions.RayError,)
        self._task = None
        self._refs: list = []

    def submit(self, function, *args):
        if self._task is None:
            self._task = self.ray.remote(num_cpus=1, max_calls=1, max_retries=0)(_call_in_worker)
        ref = self._task.remote(self.files, function, *args)
        self._refs.append(ref)
        return ref.future()

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        if cancel_futures:
            for ref in self._refs:
                try:
                    self.ray.cancel(ref, force=True)
                except Exception:  # noqa: BLE001 - a task already finished, or its worker already gone
                    pass
        self._refs = []
        if self.started and self.ray.is_initialized():
            self.ray.shutdown()
        self.started = False


def _failure(case: Case, options: RunOptions, error: BaseException) -> CaseResult:
    message = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
    failed = CaseResult.failed(f"Ray task failed ({type(error).__name__}): {message.strip()}"[:500])
    return with_base_row(case, None, options, failed)


class RayExecutor:
    """Runs a sweep's cases as Ray tasks (an executor for `bench.run.runner.run_cases`)."""

    def __init__(self, address: str | None = None):
        self.address = address

    def _start(self, ray, options: RunOptions) -> bool:
        """Connects to the cluster, or starts a local one; True when this call started it (and must stop it)."""
        return connect(ray, self.address, options.threads or 1)

    def _check_resources(self, ray, cases: list[Case], options: RunOptions) -> None:
        resources = ray.cluster_resources()
        if any(c.device == "cpu" for c in cases) and resources.get("CPU", 0) < (options.threads or 1):
            raise UsageError(f"--threads {options.threads}: the Ray cluster has {resources.get('CPU', 0):g} CPUs")
        if any(c.device == "cuda" for c in cases) and resources.get("GPU", 0) < 1:
            raise UsageError("--device cuda: the Ray cluster has no GPU")

    def __call__(self, cases: list[Case], options: RunOptions,
                 started: Callable[[int, Case], None]) -> Iterator[tuple[int, Case, CaseResult]]:
        """Submits every case's repeats at once (Ray schedules them on free resources) and yields each case as
        its last repeat finishes; `started` is not called: when a task starts is Ray's business."""
        ray = import_ray()
        stop = self._start(ray, options)
        try:
            self._check_resources(ray, cases, options)
            task = ray.remote(max_calls=1, max_retries=0)(run_job)
            files = workload_files(cases)
            pending: dict = {}
            for index, case in enumerate(cases):
                needs = {"num_gpus": 1, "num_cpus": 1} if case.device == "cuda" else {"num_cpus": options.threads}
                for repeat in range(options.repeats):
                    job = {"case": case.to_json(), "env": None, "options": asdict(options), "verify": repeat == 0,
                           "workload_files": files}
                    pending[task.options(**needs).remote(job)] = (index, repeat)
            repeats: dict[int, list[CaseResult]] = {}
            while pending:
                [ref], _ = ray.wait(list(pending), num_returns=1)
                index, _repeat = pending.pop(ref)
                case = cases[index]
                try:
                    result = with_base_row(case, {}, options, CaseResult.from_json(ray.get(ref)))
                except ray.exceptions.RayError as error:
                    result = _failure(case, options, error)
                repeats.setdefault(index, []).append(result)
                if len(repeats[index]) == options.repeats:
                    yield index, case, pool_repeats(case, repeats.pop(index), options)
        finally:
            if stop:
                ray.shutdown()
