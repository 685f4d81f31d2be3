"""Predicting a case's peak memory on a device this machine may not have: `torch.cuda.max_memory_allocated` and
`max_memory_reserved` on CUDA, or the exact live tensor bytes on the CPU.

The step runs under the exact live-tensor tracker on an engine: `fake` (PyTorch's fake tensors: shapes, dtypes and
autocast, no arithmetic; seconds at any batch size), `meta` (shapes only; no autocast) or `cpu` (a real step). For
CUDA the tracker's log of allocations and frees is replayed through a model of the caching allocator
(`bench.cuda_allocator`), with cuBLAS's workspaces. What the prediction assumes is `ASSUMPTIONS`, printed by
`python -m bench predict --device cuda`.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass, replace

import torch

from bench import cuda_allocator, measure
from bench.errors import Unsupported
from bench.fake_engine import fake_memory_pass
from bench.ranks import fake_process_group, in_rank_process
from bench.runner import MEMORY_WARMUP_STEPS, CaseMeter, bind_case, forget_traceback, memory_pass

CUDA_BLOCK_BYTES = 512
ENGINES = ("auto", "fake", "meta", "cpu")

ASSUMPTIONS = [
    "the step (after CUDA's 2 warm-up steps) runs under the exact live-tensor tracker on PyTorch's fake tensors"
    " (engine fake: the CPU's operators, no arithmetic), or as a real CPU step where fake tensors cannot run the"
    " strategy (the row says so); the CPU and CUDA kernels are assumed to return tensors of the same sizes (on the"
    " CPU a loss returns its scalar in a buffer of the loss's elements, on CUDA in a 512-byte block: fake tensors"
    " follow CUDA)",
    "autocast runs in float16 (CUDA's default) instead of the CPU's bfloat16, but with the CPU's op lists: ops that"
    " CUDA's autocast keeps in float32 and the CPU's does not (or the reverse) are off by their output size",
    "allocated and reserved replay the tracker's exact sequence of allocations and frees through a model of CUDA's"
    " caching allocator with default settings (no PYTORCH_CUDA_ALLOC_CONF): 512-byte rounding, requests up to 1 MiB"
    " from 2 MiB segments, larger ones from 20 MiB segments (under 10 MiB) or rounded to 2 MiB, best fit, blocks"
    " split when the rest is >= 512 B (small) or > 1 MiB (large), an unsplit block counted whole; one stream, no"
    " empty_cache",
    "counted, as max_memory_allocated counts them: cuBLAS's workspace (8,519,680 B per thread that runs a matrix"
    " product, 32 MiB on compute capability 9.0, or as CUBLAS_WORKSPACE_CONFIG says), one for the forward's thread"
    " and one for autograd's backward thread",
    "not modelled: cuDNN's convolution workspaces (allocated through the caching allocator for the duration of each"
    " convolution, freed after it): max_memory_allocated can exceed the prediction by the workspace of the"
    " convolution running at the peak, typically a few MiB and unbounded in principle; larger with cudnn.benchmark,"
    " whose autotuning in the warm-up steps can also leave its trial workspaces' segments in max_memory_reserved;"
    " CUDNN_CONV_WSCAP_DBG=<MiB> caps each one",
    "not counted, as max_memory_allocated does not count them: the CUDA context and kernels' own buffers outside"
    " the caching allocator",
]


@dataclass
class TrackedStep:
    """One tracked steady-state step: its exact peak of live tensor bytes (rounded per storage to `block_bytes`)
    and, when recorded, the tracker's event log."""

    peak_bytes: int
    events: list | None
    engine: str


class _UsesAutocast(Exception):
    """Raised by the meta engine when the strategy turns autocast on: meta tensors ignore autocast."""


def _cuda_like_forward(strategy, engine: str):
    """The strategy's forward context, with CPU autocast switched to float16 (CUDA's autocast dtype)."""
    original = strategy.forward

    @contextlib.contextmanager
    def forward():
        with original():
            if torch.is_autocast_enabled("cpu"):
                if engine == "meta":
                    raise _UsesAutocast()
                with torch.autocast("cpu", dtype=torch.float16):
                    yield
            else:
                yield

    return forward


def tracked_step(case, spec: str, engine: str = "fake", block_bytes: int = 1, cuda_autocast: bool = True,
                 ranks: int = 1, record_events: bool = False, warmup_steps: int | None = None,
                 planned=None) -> TrackedStep:
    """One steady-state step of `case` (its device is ignored) tracked on `engine` (fake, meta or cpu); for a
    sharded strategy, the rank with the largest peak of its `ranks` ranks, each run in turn in this process as that
    rank of PyTorch's fake process group, on the CPU (shards of the batch and of parameters differ by rank).
    `planned`: the strategy bound to the CPU whose `plan()` has run (a checkpoint budget's plan), used as it is."""
    strategy = planned if planned is not None else bind_case(replace(case, strategy=spec, device="cpu"), ranks)[0]
    if strategy.distributed and not in_rank_process():
        steps = []
        for rank in range(ranks):
            with fake_process_group(ranks, rank):
                steps.append(tracked_step(case, spec, "cpu", block_bytes, cuda_autocast, ranks, record_events,
                                          warmup_steps))
        return max(steps, key=lambda step: step.peak_bytes)
    if cuda_autocast:
        strategy.forward = _cuda_like_forward(strategy, engine)
    device = "cpu" if engine == "fake" else engine
    tracker = measure.LiveTensorTracker(device, block_bytes=block_bytes, record_events=record_events)
    # the peak only: no step after the measured one (mem_growth_bytes_per_step is not predicted)
    options = {"warmup_steps": warmup_steps, "growth_steps": 0}
    if engine == "fake":
        memory = fake_memory_pass(replace(case, device="cpu"), strategy, tracker=tracker, **options)
    else:
        memory = memory_pass(replace(case, device=engine), strategy, tracker=tracker, **options)
    return TrackedStep(int(memory["peak_mem_bytes"]), tracker.events if record_events else None, engine)


def tracked_peak(case, spec: str, engine: str = "fake", block_bytes: int = CUDA_BLOCK_BYTES,
                 cuda_autocast: bool = True, ranks: int = 1) -> int:
    """The tracked peak of one steady-state step of `case` on `engine` (see `tracked_step`)."""
    return tracked_step(case, spec, engine, block_bytes, cuda_autocast, ranks).peak_bytes


def device_capability() -> tuple[int, int] | None:
    """The compute capability of this machine's CUDA device 0, or None without one."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_capability(0)
    return None


def cublas_workspace(capability: tuple[int, int] | None) -> int:
    """cuBLAS's workspace per handle and stream: PyTorch's own figure where this torch can say it (a CUDA build
    with a GPU), else CUBLAS_WORKSPACE_CONFIG or the default for `capability`."""
    if torch.cuda.is_available() and hasattr(torch.backends.cuda, "cublas_workspace_size"):
        return int(torch.backends.cuda.cublas_workspace_size())
    return cuda_allocator.workspace_from_environment(capability)


# aten operators that run cuDNN's convolutions on CUDA (with their algorithm's workspace for the call's duration)
CONVOLUTION_OPS = ("convolution", "convolution_backward", "cudnn_convolution")


def cudnn_workspace_cap() -> int | None:
    """The cap on each cuDNN convolution workspace that CUDNN_CONV_WSCAP_DBG (MiB, PyTorch's documented debug
    variable) sets, in bytes; None when it is not set or not a number."""
    text = os.environ.get("CUDNN_CONV_WSCAP_DBG", "")
    return int(text) * 2**20 if text.isdigit() else None


def _engines(engine: str) -> list[str]:
    """The engines to try in turn for `--engine`: auto is the fake engine, a real CPU step where it fails."""
    return ["fake", "cpu"] if engine == "auto" else [engine]


class PredictionMeter(CaseMeter):
    """What a strategy's `plan()` measures, for predict: nothing runs on the case's device, so the peaks it would
    measure (the baseline's, a candidate plan's) are predicted as well."""

    def __init__(self, case):
        super().__init__(replace(case, device="cpu"))

    def measured_peak(self, strategy) -> int:
        return self.predicted_peak(strategy)


def predict_case(case, engine: str = "auto", ranks: int = 1, capability: tuple[int, int] | None = None) -> dict:
    """One prediction row: strategy, phase, batch, the predicted peak (`predicted_bytes`: max_memory_allocated on
    CUDA, exact live bytes on the CPU), on CUDA `predicted_reserved_bytes` (max_memory_reserved) and the cuBLAS
    workspace counted, the engine used, status and message; for a sharded strategy the largest of `ranks` ranks.
    `capability` is the CUDA device's compute capability (default: this machine's, else not Hopper)."""
    row = {"workload": case.workload, "strategy": case.strategy, "phase": case.phase,
           "batch_size": case.batch_size, "device": case.device, "predicted_bytes": None,
           "predicted_mib": None, "predicted_reserved_bytes": None, "predicted_reserved_mib": None,
           "cublas_workspace_bytes": None, "cudnn_workspace_bound_bytes": None, "engine": None, "status": "ok",
           "message": "", "ranks": 1}
    with warnings.catch_warnings():
        # binding a strategy to `cuda` on a machine without CUDA: predict only reads its spec and checks it, and
        # runs it on the CPU; a GradScaler's "CUDA is not available. Disabling." is about a scaler never used
        warnings.filterwarnings("ignore", message=".*GradScaler is enabled, but CUDA is not available.*")
        strategy, context = bind_case(case, ranks)
    row["strategy"] = strategy.spec()
    try:
        strategy.check(context)
    except Unsupported as error:
        row.update(status="unsupported", message=str(error))
        return row
    planned = bind_case(replace(case, device="cpu"), ranks)[0]  # the strategy the step runs, bound to the CPU
    try:
        planned.plan(PredictionMeter(case))  # a checkpoint:budget chooses its plan, on predictions alone
    except Unsupported as error:
        row.update(status="unsupported", message=str(error))
        return row
    if "checkpoint.planning_s" in planned.describe():
        row["message"] = "plan chosen on predicted peaks, not confirmed by a run"
    if strategy.cpu_memory_count != "live_tensors":
        row.update(status="unsupported", message=f"{row['strategy']}: predict runs the step under the exact tracker, a "
                   "dispatch mode under which dynamo runs the model eagerly, so the compiled step's memory cannot be "
                   "predicted; measure it (`compare --device cpu` counts it at the CPU allocator)")
        return row
    cuda = case.device == "cuda"
    if strategy.distributed:
        row.update(ranks=ranks, message=f"largest rank of {ranks}, fake process group")
        engines = ["cpu"]
    else:
        engines = _engines(engine)
    notes = [row["message"]] if row["message"] else []
    for name in engines:
        try:
            step = tracked_step(case, row["strategy"], name, 1, cuda_autocast=cuda, ranks=ranks, record_events=cuda,
                                warmup_steps=MEMORY_WARMUP_STEPS["cuda"] if cuda else None, planned=planned)
        except Unsupported as error:  # found when the strategy meets the model (no ReLU to switch): no engine can
            row.update(status="unsupported", message=str(error))
            return row
        except Exception as error:  # noqa: BLE001 - an engine may not run a strategy; the next one is the fallback
            forget_traceback(error)
            why = "autocast" if isinstance(error, _UsesAutocast) else type(error).__name__
            if name == engines[-1]:
                row.update(status="error", message=f"{type(error).__name__}: {error}".splitlines()[0][:300])
                return row
            notes.append(f"{name} engine failed ({why}): ran on the {engines[engines.index(name) + 1]}")
            continue
        row.update(engine=name, message="; ".join(notes))
        if cuda:
            workspace = cublas_workspace(capability or device_capability())
            replayed = cuda_allocator.replay(step.events, workspace)
            row.update(predicted_bytes=replayed.max_allocated_bytes,
                       predicted_reserved_bytes=replayed.max_reserved_bytes,
                       predicted_reserved_mib=round(replayed.max_reserved_bytes / 2**20, 1),
                       cublas_workspace_bytes=replayed.cublas_workspaces * workspace)
            if any(e.kind == "op" and e.op.startswith(CONVOLUTION_OPS) for e in step.events):
                row["cudnn_workspace_bound_bytes"] = cudnn_workspace_cap()
                cap = row["cudnn_workspace_bound_bytes"]
                notes.append("cuDNN conv workspace not modelled" + (f" (<= {cap / 2**20:,.0f} MiB more)" if cap else ""))
                row["message"] = "; ".join(notes)
        else:
            row["predicted_bytes"] = step.peak_bytes
        row["predicted_mib"] = round(row["predicted_bytes"] / 2**20, 1)
        return row
    return row


def format_predictions(rows: list[dict]) -> str:
    """The console table: allocated (and on CUDA reserved) per case, the engine and any note."""
    cuda = any(r["device"] == "cuda" for r in rows)
    header = (f"{'strategy':<28} {'phase':<5} {'batch':>5} {'allocated bytes':>16} {'MiB':>9} "
              + (f"{'reserved MiB':>12} {'cuBLAS MiB':>10} " if cuda else "") + f"{'engine':<6}  note")
    lines = [header, "-" * len(header)]
    for r in rows:
        b = f"{r['predicted_bytes']:,}" if r["predicted_bytes"] is not None else "-"
        m = f"{r['predicted_mib']:.1f}" if r["predicted_mib"] is not None else "-"
        extra = ""
        if cuda:
            reserved = r.get("predicted_reserved_mib")
            workspace = r.get("cublas_workspace_bytes")
            extra = (f"{reserved:>12.1f} " if reserved is not None else f"{'-':>12} ") + \
                    (f"{workspace / 2**20:>10.1f} " if workspace is not None else f"{'-':>10} ")
        note = r["status"] if r["status"] != "ok" else ""
        note = "; ".join(x for x in (note, r["message"]) if x)
        lines.append(f"{r['strategy']:<28} {r['phase']:<5} {r['batch_size']:>5} {b:>16} {m:>9} {extra}"
                     f"{r['engine'] or '-':<6}  {note}")
    return "\n".join(lines)
