"""Where an analysis evaluates its candidates (`plan`) or probes (`fit`) several at once: in this process (one job),
in worker processes forked from this one (`jobs` > 1), or as Ray tasks (`executor="ray"`, each a fresh worker
process: `bench.run.ray_executor.RayPool`).

Every pool has the interface of `concurrent.futures`' executors that the searches use, `submit(function, *args)`
giving a Future and `shutdown(wait, cancel_futures)`, and two attributes: `slots`, how many calls may run at once,
and `lost`, the errors that mean a worker died (its candidate or probe becomes a row saying so; the search goes on).
Functions and arguments travel by pickling: module-level functions and plain values only.
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import multiprocessing
import multiprocessing.forkserver
import signal
from concurrent.futures.process import BrokenProcessPool

import torch

from bench.core import processes
from bench.measure.quiet_tracing import quiet_tracing

LOCAL, RAY = "local", "ray"


class Inline:
    """A pool that runs each call at once in this process (one job)."""

    slots = 1
    lost: tuple = ()

    def submit(self, function, *args):
        future: futures.Future = futures.Future()
        try:
            future.set_result(function(*args))
        except BaseException as error:  # noqa: BLE001 - delivered where the result is read, as a pool does
            future.set_exception(error)
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


def worker_start() -> None:
    """A local worker's start: it dies with its parent (and SIGTERM ends it, whatever handler a forked worker
    inherited), the plugins, Ctrl-C left to the parent, one thread (fake tensors do no arithmetic)."""
    from bench.run._worker import import_plugins

    processes.default_signals()  # a forked worker inherits its parent's handlers: pool.terminate() must end it
    processes.die_with_parent()  # a parent killed outright (SIGKILL) leaves no worker behind
    import_plugins()  # a forkserver's worker: the plugins the parent's process imported (the fake-CUDA mode)
    quiet_tracing()  # as its parent (a forkserver's worker does not inherit the filters)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it ends its workers
    torch.set_num_threads(1)  # one thread each, and no OpenMP pool across the fork


class _Local(futures.ProcessPoolExecutor):
    lost = (BrokenProcessPool,)

    def __init__(self, jobs: int, context):
        super().__init__(jobs, mp_context=context, initializer=worker_start)
        self.slots, self.context = jobs, context

    def restarted(self) -> "_Local":
        """A new pool of as many workers, this one (broken: a worker died) shut down."""
        self.shutdown(wait=False, cancel_futures=True)
        return _Local(self.slots, self.context)


def local(jobs: int, preload: str, workload: str | None = None):
    """One job: this process. More: forked workers; where this torch sees CUDA (the fake-CUDA environment's, or a
    GPU), which a forked child cannot use again, workers forked from a fresh server process that imported the
    module `preload` once, and what a `workload`'s steps import that does not initialise CUDA (`start_server`)."""
    if jobs <= 1:
        return Inline()
    if torch.cuda.is_available():
        start_server(jobs, preload, workload)
        context = multiprocessing.get_context("forkserver")
    else:
        context = multiprocessing.get_context("fork")
    return _Local(jobs, context)


def start_server(jobs: int, preload: str, workload: str | None = None) -> None:
    """Where `local` forks its workers from a server (`jobs` > 1, a torch that sees CUDA), that server started now, if
    it is not running yet: its imports then run beside what this process does first (a search's baseline), not
    after it. It imports the module `preload`, torch._dynamo (every fake-CUDA step's FakeTensorMode imports it) and
    for an `hf:` workload transformers (`workloads.framework.transformers_preload`), none of which asks torch about
    CUDA devices (a child forked after that could not use CUDA): each worker's first candidate imported them."""
    if jobs <= 1 or not torch.cuda.is_available():
        return
    modules = [preload, "torch._dynamo"]
    if workload is not None and workload.startswith("hf:"):
        modules.append("workloads.framework.transformers_preload")
    multiprocessing.forkserver.set_forkserver_preload(modules)
    multiprocessing.forkserver.ensure_running()


def ray(jobs: int | None, address: str | None, workload: str | None = None):
    """Ray tasks on the cluster at `address` (None: a local Ray started for this pool and stopped with it), `jobs`
    at once (None: the cluster's CPUs); a `workload` given as `file.py:NAME` travels to them as its source."""
    from bench.run.ray_executor import RayPool

    return RayPool(address, jobs, (workload,) if workload else ())


def end(pool) -> None:
    """Ends the work of `pool` now (Ctrl-C, an error): its local worker processes are terminated, its Ray tasks
    cancelled, without waiting for what they run."""
    processes = dict(getattr(pool, "_processes", None) or {})
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes.values():
        process.terminate()


def default_jobs() -> int:
    """Worker processes for a search: the cores this process may use, at most 4."""
    from bench.run.preflight import available_cores

    return max(1, min(4, available_cores()))


def probe_pool(jobs: int, executor: str, ray_address: str | None, preload: str, workload: str | None = None):
    """Where a fit's probes are made several at once: None for one job here (the serial search), worker processes
    forked from this one for `jobs` > 1 (`preload`: the module they import first), Ray tasks with `executor="ray"`
    (`jobs` at once; 0: the cluster's CPUs; the `workload`'s file travels to them)."""
    if executor == RAY:
        return ray(jobs or None, ray_address, workload)
    return local(jobs, preload, workload) if jobs > 1 else None


@contextlib.contextmanager
def opened(pool):
    """`pool` for a with-block: shut down after it, its workers ended at once after an error or Ctrl-C."""
    try:
        yield pool
    except BaseException:
        if pool is not None:
            end(pool)
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
