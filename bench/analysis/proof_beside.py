"""Layer replay's proof trace run beside its smaller traces, in a worker process forked before CUDA was initialised,
where a second core is free: the proof, the largest of a replay's traces, then costs no wall time of its own.

bench.analysis.layer_replay traces a step at a few layer counts and proves the log it builds from the smaller traces
against one more trace (the proof), which needs nothing of theirs: it can run at the same time on another core, and
so can one of the three smaller traces of a plan of two kinds of layers (the worker takes it first, then the proof,
and this process the other two). A process forked after this one asked torch anything of CUDA cannot use CUDA (torch
refuses), and in the fake-CUDA environment reading a workload does (torchao asks for the device's capability when
transformers imports it), so the worker is forked early (`stand_by`: the CLI's `predict`, and `fit --over seq_len`
in one process, before they read the workload, `predict.predict_cases` before its first case; only for a workload
whose spec says it may replay its layers, `layer_replay.might_replay`), kept for this process's life (a second
prediction in the same process finds it ready), and given the trace's arguments (a Case, the strategy spec, the
engine, ...: what `layer_replay.tracer` takes). It traces the step as this process would and sends it back without
its tracker.

No worker stands by with one core, in a multiprocessing pool's worker (a search's: its cores are the pool's), where
this process asked torch about CUDA before the first `stand_by`, or with MEMBENCH_PROOF_BESIDE=0; a trace that a plan
counts operators of (`prepare`) is never sent. Then, or where the worker fails (an exception, a worker that died) or
has not started the trace when it is wanted, the trace runs here, in the order it always did. No figure depends on
where a trace ran: the same code traces the same step (tests_cuda_fake/test_proof_beside_fake_cuda.py compares the
rows).
"""

from __future__ import annotations

import concurrent.futures as futures
import multiprocessing
import os
import pickle
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace

import torch

from bench.core.collector import collector_paused
from bench.core.job_environment import PROOF_BESIDE_VARIABLE
from bench.measure.memory import MemoryEvent


# "pool": the executor, "pid": the process that forked it (a fork of that process inherits none); "refused": the
# process whose worker could not use CUDA
_worker: dict = {}


def enabled() -> bool:
    """Whether this process may fork a worker for its proofs: MEMBENCH_PROOF_BESIDE not "0", a second core, a torch
    that sees CUDA (fake-CUDA's stubs or a GPU: layer replay runs on the fake-cuda engine only), and not itself a
    worker of a multiprocessing pool (a search's, whose cores the pool has, or this module's)."""
    from bench.run.preflight import available_cores

    return (os.environ.get(PROOF_BESIDE_VARIABLE, "1") != "0" and multiprocessing.parent_process() is None
            and available_cores() >= 2 and torch.version.cuda is not None)  # not is_available(): see `stand_by`


def stand_by(workload: str | None = None) -> bool:
    """Forks the worker now where it may be (see the module) and none stands by yet; whether one stands by. The
    worker then reads `workload` (a spec), importing what its model needs, while this process does the same.

    A child forked after this process asked torch anything of CUDA (`torch.cuda.is_available()` included, which
    registers torch's fork guard without initialising CUDA) cannot use CUDA, and nothing says so here: the child
    answers whether it can (`_usable`), and a worker that cannot is ended (and none is tried again)."""
    if _standing() is not None:
        return True
    if _worker.get("refused") == os.getpid() or not enabled() or torch.cuda.is_initialized():
        return False
    from bench.analysis.pools import worker_start

    pool = futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"), initializer=worker_start)
    try:
        usable = pool.submit(_usable).result()  # forks it now
    except Exception:  # noqa: BLE001 - no worker: the proofs run here
        usable = False
    if not usable:
        pool.shutdown(wait=False, cancel_futures=True)
        _worker["refused"] = os.getpid()
        return False
    _worker.update(pool=pool, pid=os.getpid())
    if workload is not None:
        pool.submit(_read, workload)  # not waited for: a proof sent later waits behind it
    return True


def _standing():
    """The standing worker's executor, or None (never one this process inherited by a fork)."""
    return _worker["pool"] if _worker.get("pid") == os.getpid() else None


def _usable() -> bool:
    """In the worker: whether it may use CUDA (its parent had not yet asked torch of CUDA when it forked)."""
    return not torch.cuda._is_in_bad_fork()


def _read(workload: str) -> None:
    """In the worker: the workload read as a prediction reads it (its configuration, its packages imported); an
    error is left to the prediction that meets it."""
    from workloads import get_workload

    try:
        get_workload(workload)
    except Exception:  # noqa: BLE001
        pass


def submit(trace, count: int, plain: int | None, repeat_warmup: bool = False):
    """The trace `trace(count, plain, repeat_warmup)` started in the worker: a Future of its step, or None where it
    runs here (no worker, or a trace that cannot be sent: one with a `prepare`, see `layer_replay.tracer`)."""
    pool = _standing()
    arguments = getattr(trace, "arguments", None)
    if pool is None or arguments is None:
        return None
    try:
        return pool.submit(_traced, trace.made_by, arguments, count, plain, repeat_warmup)
    except RuntimeError:  # a broken or shut-down pool
        _forget(pool)
        return None


def result(future, trace, count: int, plain: int | None, repeat_warmup: bool = False):
    """The step of `submit`'s trace: the worker's, or traced here where there is no `future`, the worker has not
    started it yet (still busy with an earlier prediction's, or still reading the workload), or failed."""
    if future is not None and not future.cancel():
        try:
            return _unpacked(future.result())
        except BrokenProcessPool:
            _forget(_standing())
        except Exception:  # noqa: BLE001 - the trace here raises it again, as it would have without the worker
            pass
    return trace(count, plain, repeat_warmup=repeat_warmup)


def made_while_waiting(proof, make, *counts):
    """`make(*counts)` (a log layer replay's template makes) as a function that returns it: made now where the
    `proof` runs in the worker beside this process (a Future: `submit`'s), so that this process makes it while it
    would only wait, else when asked for, as before. What making it raised now is raised when it is asked for,
    where it always was (a proof that fails is told apart from a template that cannot make a log by the order they
    are found in)."""
    if proof is None:
        return lambda: make(*counts)
    try:
        made = make(*counts)
    except Exception as error:  # noqa: BLE001 - raised again where the log is asked for
        failure = error

        def raise_again():
            raise failure
        return raise_again
    return lambda: made


def _forget(pool) -> None:
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)
    _worker.clear()


def _traced(tracer, arguments: tuple, count: int, plain: int | None, repeat_warmup: bool) -> bytes:
    """In the worker: the step `tracer(*arguments)` (`layer_replay.tracer`) traces at `count` (and `plain`) layers,
    its tracker left here (it holds the fake tensors; the caller reads the log), packed (`_packed`)."""
    step = tracer(*arguments)(count, plain, repeat_warmup=repeat_warmup)
    return _packed(replace(step, tracker=None))


def _packed(step) -> bytes:
    """A traced step pickled as the worker sends it: its events as plain tuples (a named tuple pickles through a
    Python call each, and unpickles through another: 0.45 and 0.29 s for 66,000 events here, 0.08 and 0.09 s as
    tuples), the collector paused (after a trace the worker's heap is large, and the objects pickling makes set off
    its full collections: the proof of QLoRA's 8B plan reached this process 1.5 s after the worker had traced it)."""
    with collector_paused():
        events = None if step.events is None else [tuple(event) for event in step.events]
        return pickle.dumps(replace(step, events=events), protocol=pickle.HIGHEST_PROTOCOL)


def _unpacked(payload: bytes):
    """The step `_packed` packed, its events MemoryEvents again."""
    with collector_paused():
        step = pickle.loads(payload)
        return step if step.events is None else replace(step, events=list(map(MemoryEvent._make, step.events)))
