"""Predicting `torch.cuda.max_memory_allocated` of a case on a machine without a GPU.

The step runs under the exact live-tensor tracker, on the CPU or on the meta device (shapes only, no
arithmetic: fast at any batch size), with each storage rounded up to the CUDA caching allocator's 512-byte
block. What the prediction assumes is in `ASSUMPTIONS`, printed by `python -m bench predict`.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import replace

import torch

from bench import measure
from bench.errors import Unsupported
from bench.ranks import fake_process_group, in_rank_process
from bench.runner import bind_case, memory_pass

CUDA_BLOCK_BYTES = 512
ENGINES = ("auto", "meta", "cpu")
AUTO_CPU_MAX_BATCH = 16  # engine auto: the CPU up to this batch size, meta above

ASSUMPTIONS = [
    "the step runs under the exact live-tensor tracker (on the meta device, or on the CPU where meta cannot run it:"
    " autocast, or a strategy meta does not support); every storage is rounded up to 512 bytes, as CUDA's caching"
    " allocator rounds each block (math.ceil(n/512)*512)",
    "autocast runs in float16 (CUDA's default) instead of the CPU's bfloat16, but with the CPU's op lists: ops that"
    " CUDA's autocast keeps in float32 and the CPU's does not (or the reverse) are off by their output size",
    "not counted, as max_memory_allocated does not count them: the CUDA context, cuBLAS/cuDNN workspaces and"
    " kernels' internal buffers (cuDNN benchmark workspaces are not tensors), and cached-but-free blocks (reserved)",
    "the allocator's block splitting and large-block (2 MiB segment) rounding affect reserved memory only; the CPU"
    " and CUDA kernels are assumed to return the same tensors (same saved tensors in autograd)",
]


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


def tracked_peak(case, spec: str, engine: str = "meta", block_bytes: int = CUDA_BLOCK_BYTES,
                 cuda_autocast: bool = True, ranks: int = 1) -> int:
    """The tracked peak of one steady-state step of `case` (its device is ignored) on `engine` (meta or cpu); for
    a sharded strategy, the largest of its `ranks` ranks' peaks, each run in turn in this process as that rank of
    PyTorch's fake process group, on the CPU (shards of the batch and of parameters differ in size by rank)."""
    strategy, _ = bind_case(replace(case, strategy=spec, device="cpu"), ranks)
    if strategy.distributed and not in_rank_process():
        peaks = []
        for rank in range(ranks):
            with fake_process_group(ranks, rank):
                peaks.append(tracked_peak(case, spec, "cpu", block_bytes, cuda_autocast, ranks))
        return max(peaks)
    if cuda_autocast:
        strategy.forward = _cuda_like_forward(strategy, engine)
    tracker = measure.LiveTensorTracker(engine, block_bytes=block_bytes)
    memory = memory_pass(replace(case, device=engine), strategy, tracker=tracker)
    return int(memory["peak_mem_bytes"])


def predict_case(case, engine: str = "auto", ranks: int = 1) -> dict:
    """One prediction row: strategy, phase, batch, predicted bytes, the engine used, status and message; for a
    sharded strategy the peak of the largest of `ranks` ranks."""
    row = {"workload": case.workload, "strategy": case.strategy, "phase": case.phase,
           "batch_size": case.batch_size, "device": case.device, "predicted_bytes": None,
           "predicted_mib": None, "engine": None, "status": "ok", "message": "", "ranks": 1}
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
    block = CUDA_BLOCK_BYTES if case.device == "cuda" else 1
    if strategy.distributed:
        row.update(ranks=ranks, message=f"largest rank of {ranks}, fake process group")
        engines = ["cpu"]
    elif engine == "auto":  # the CPU is exact and cheap at small batches; meta is fast at any batch
        engines = ["cpu"] if case.batch_size <= AUTO_CPU_MAX_BATCH else ["meta", "cpu"]
    else:
        engines = [engine]
    for name in engines:
        try:
            peak = tracked_peak(case, row["strategy"], name, block, cuda_autocast=case.device == "cuda", ranks=ranks)
        except _UsesAutocast:
            row["message"] = "autocast: ran on the CPU"
            continue
        except Exception as error:  # noqa: BLE001 - meta may not support a strategy; the CPU is the fallback
            if name == engines[-1]:
                row.update(status="error", message=f"{type(error).__name__}: {error}".splitlines()[0][:300])
                return row
            row["message"] = f"meta failed ({type(error).__name__}): ran on the CPU"
            continue
        row.update(predicted_bytes=peak, predicted_mib=round(peak / 2**20, 1), engine=name)
        return row
    return row


def format_predictions(rows: list[dict]) -> str:
    header = f"{'strategy':<28} {'phase':<5} {'batch':>5} {'predicted bytes':>16} {'MiB':>9} {'engine':<6}  note"
    lines = [header, "-" * len(header)]
    for r in rows:
        b = f"{r['predicted_bytes']:,}" if r["predicted_bytes"] is not None else "-"
        m = f"{r['predicted_mib']:.1f}" if r["predicted_mib"] is not None else "-"
        note = r["status"] if r["status"] != "ok" else ""
        note = "; ".join(x for x in (note, r["message"]) if x)
        lines.append(f"{r['strategy']:<28} {r['phase']:<5} {r['batch_size']:>5} {b:>16} {m:>9} "
                     f"{r['engine'] or '-':<6}  {note}")
    return "\n".join(lines)
