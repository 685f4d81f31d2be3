"""Predicting a case's peak memory on a device this machine may not have: `torch.cuda.max_memory_allocated` and
`max_memory_reserved` on CUDA, or the exact live tensor bytes on the CPU.

The step runs under the exact live-tensor tracker on an engine: `fake-cuda` (CUDA's own operators on fake tensors,
in the fake-CUDA environment's Python, `bench.measure.fake_cuda`: a subprocess when this Python is another), `fake`
(PyTorch's fake tensors with the CPU's operators: shapes, dtypes and autocast, no arithmetic; seconds at any batch
size), `meta` (shapes only; no autocast) or `cpu` (a real step). For CUDA the tracker's log of allocations and frees
is replayed through a model of the caching allocator (`bench.measure.cuda_allocator`), with cuBLAS's workspaces.
What the prediction assumes, per engine used, is `assumptions()`, printed by `python -m bench predict --device cuda`.
Each case is one row of the declared predict table (`bench.core.results.PREDICT`).
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import torch

from bench.analysis import layer_replay, layer_replay_ranks, proof_beside
from bench.analysis.fake_cuda_worker import run_in_fake_cuda
from bench.analysis.fake_engine import (
    PredictionMeter, TrackedStep, UsesAutocast, bound_device, cublas_workspace, device_capability, real_step_refusal,
    tracked_step,
)
from bench.core import memory_categories
from bench.core.errors import Unsupported, UsageError
from bench.core.results import PREDICT, Status
from bench.core.schema import Row
from bench.core.units import MiB
from bench.measure import breakdown, cuda_allocator, fake_cuda, snapshot
from bench.measure.op_scratch import OperatorScratch
from bench.run.isolation import process_state
from bench.run.case import bind_case
from bench.run.runner import MEMORY_WARMUP_STEPS, forget_traceback
from strategies.framework.composite import members_of

ENGINES = ("auto", "fake-cuda", "fake", "meta", "cpu")
CUDA_ONLY_ENGINES = ("fake-cuda",)

def _engines(engine: str, cuda: bool) -> list[str]:
    """The engines to try in turn for `--engine`: auto is the fake engine (for CUDA on CUDA's operators where this
    process's torch sees a CUDA device, the fake-CUDA environment's or a GPU), a real CPU step where it fails."""
    if engine != "auto":
        return [engine]
    return (["fake-cuda"] if cuda and torch.cuda.is_available() else []) + ["fake", "cpu"]


# A CUDA case traced on the CPU's operators runs the CPU's attention kernel, which keeps no attention probabilities;
# CUDA picks flash, memory-efficient, cuDNN or math by dtype, heads and mask, and math keeps them (batch x heads x
# sequence^2 per layer): llama-3.1-8b at 4096 tokens in float32 (grouped-query heads: math) 209.8 GiB on fake CUDA,
# 146.2 GiB on the CPU's operators.
CPU_ATTENTION_NOTE = ("attention on the CPU's kernel: CUDA's choice (flash, memory-efficient, cuDNN or math, which "
                      "keeps the attention probabilities) is not modelled without the fake-CUDA environment "
                      "(`make cuda-fake-env`), so the peak may be low")


class _NoPrediction(Exception):
    """Why a case gets no predicted figure: the status and message of its row."""

    def __init__(self, status: Status, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def predict_case(case, engine: str = "auto", ranks: int = 1, capability: tuple[int, int] | None = None,
                 snapshot_dir: str | None = None) -> Row:
    """One row of the predict table (`bench.core.results.PREDICT`): strategy, phase, batch, the predicted peak
    (`predicted_bytes`: max_memory_allocated on CUDA, exact live bytes on the CPU), on CUDA
    `predicted_reserved_bytes` (max_memory_reserved) and the cuBLAS workspace counted, the engine used, status and
    message; for a sharded strategy the largest of `ranks` ranks. `capability` is the CUDA device's compute
    capability (default: this machine's, else not Hopper).

    The steps: bind and check the strategy, plan it on each engine's device, run one tracked step on the first
    engine that can, and turn the step into the row's figures (on CUDA, through the caching allocator's model).
    With `snapshot_dir` the step's memory snapshot is written there (`bench.measure.snapshot`)."""
    row = _empty_row(case)
    strategy, context = _bound_strategy(case, ranks)
    context.capability = capability  # the predicted GPU's, where a strategy's check depends on it (float8)
    row["strategy"] = strategy.spec()
    try:
        _check(strategy, context)
        engines = _engines(engine, case.device == "cuda")
        if strategy.distributed:  # the ranks run in turn in this process, on real CPU tensors or on fake CUDA ones
            engines = [name for name in engines if name != "fake"] or ["cpu"]
        planned = _planned_strategies(case, engines, ranks)
        notes = _notes_before_the_step(strategy, planned, ranks)
        notes += [note for note in [getattr(context.workload, "prediction_note", lambda: None)()] if note]
        row["workload_source"] = getattr(context.workload, "definition_source", lambda: None)()
        if strategy.distributed:
            row["ranks"] = ranks
        row["message"] = "; ".join(notes)
        name, step = _first_engine_that_runs(case, row["strategy"], engines, planned, ranks, notes,
                                             record_events=case.device == "cuda" or snapshot_dir is not None,
                                             capability=capability, auto=engine == "auto",
                                             snapshot=snapshot_dir is not None)
        if case.device == "cuda" and step.cpu_sdpa_calls:
            notes.append(CPU_ATTENTION_NOTE)
        if strategy.distributed and 0 < len(step.ranks_traced) < ranks:
            notes.append(ranks_traced_note(step.ranks_traced, ranks))
        row.update(engine=name, message="; ".join(notes), sdpa_kernel=step.sdpa_kernel,
                   recompute_plan=step.recompute_plan, offload_host_peak_bytes=step.offload_host_peak_bytes)
        _fill_figures(row, step, capability, notes)
        if snapshot_dir is not None:
            _write_snapshot(case, row, step, capability, snapshot_dir)
    except _NoPrediction as refusal:
        row.update(status=refusal.status.value, message=refusal.message)
    return row


def _empty_row(case) -> Row:
    """The predict row of `case` before anything ran: every figure empty, status ok."""
    row = PREDICT.row({name: None for name in PREDICT.names if name != "schema_version"})
    row.update(workload=case.workload, strategy=case.strategy, phase=case.phase, batch_size=case.batch_size,
               device=case.device, status=Status.OK.value, message="", ranks=1)
    return row


def _bound_strategy(case, ranks: int):
    """(strategy, context): the case's strategy bound to its device, which may be CUDA on a machine without it."""
    with warnings.catch_warnings():
        # binding a strategy to `cuda` on a machine without CUDA: predict only reads its spec and checks it, and
        # runs it on the CPU; a GradScaler's "CUDA is not available. Disabling." is about a scaler never used
        warnings.filterwarnings("ignore", message=".*GradScaler is enabled, but CUDA is not available.*")
        return bind_case(case, ranks)


def _check(strategy, context) -> None:
    """_NoPrediction when the strategy does not apply to the case (`Strategy.check`)."""
    try:
        strategy.check(context)
    except Unsupported as error:
        raise _NoPrediction(Status.UNSUPPORTED, str(error)) from None


def _planned_strategies(case, engines: list[str], ranks: int) -> dict:
    """The strategy each engine's step runs, by device: bound to that device and planned (a checkpoint:budget
    chooses its plan on predicted peaks alone); _NoPrediction when no plan can be made."""
    planned = {}
    try:
        for device in dict.fromkeys(bound_device(name) for name in engines):
            planned[device] = bind_case(replace(case, device=device), ranks)[0]
            planned[device].plan(PredictionMeter(case))
    except Unsupported as error:
        raise _NoPrediction(Status.UNSUPPORTED, str(error)) from None
    return planned


def _notes_before_the_step(strategy, planned: dict, ranks: int) -> list[str]:
    """What the row's message says before any step runs: what the prediction of a member assumes
    (`Strategy.prediction_note`), then a plan chosen on predictions, or the sharded ranks (the latter replaces the
    former)."""
    notes = [m.prediction_note for m in members_of(strategy) if m.prediction_note]
    if strategy.distributed:
        return notes + [f"largest rank of {ranks}, fake process group"]
    if any("checkpoint.planning_s" in s.describe() for s in planned.values()):
        return notes + ["plan chosen on predicted peaks, not confirmed by a run"]
    return notes


def _first_engine_that_runs(case, spec: str, engines: list[str], planned: dict, ranks: int,
                            notes: list[str], record_events: bool = False,
                            capability: tuple[int, int] | None = None, auto: bool = True, snapshot: bool = False
                            ) -> tuple[str, TrackedStep]:
    """(engine, its tracked step) of the first of `engines` that runs the case, each failure before it added to
    `notes`; _NoPrediction when the strategy does not fit the model (no engine can run it) or the last one fails.
    A decoder stack whose layers are all alike is traced at a few layers and its step built by layer replay
    (`bench.analysis.layer_replay`), proven equal to a real trace first; the row's message says so, or why the
    full trace ran where layer replay applied but was refused."""
    cuda = case.device == "cuda"
    for name in engines:
        refusal = real_step_refusal(planned["cpu"].context.workload, case.phase) if name == "cpu" and auto else None
        if refusal is not None:  # no real step of a model this machine cannot hold, unless --engine cpu asks for it
            raise _NoPrediction(Status.UNSUPPORTED, "; ".join(
                [note.replace(": ran on the cpu", "") for note in notes] + [refusal]))
        try:
            step = _replayed_step(case, spec, name, planned[bound_device(name)], ranks, notes, snapshot, capability)
            if step is not None:
                return name, step
            return name, tracked_step(case, spec, name, 1, cuda_autocast=cuda, ranks=ranks,
                                      record_events=record_events,
                                      warmup_steps=MEMORY_WARMUP_STEPS["cuda"] if cuda else None,
                                      planned=planned[bound_device(name)], capability=capability)
        except Unsupported as error:  # found when the strategy meets the model (no ReLU to switch): no engine can
            raise _NoPrediction(Status.UNSUPPORTED, str(error)) from None
        except Exception as error:  # noqa: BLE001 - an engine may not run a strategy; the next one is the fallback
            forget_traceback(error)
            if name == engines[-1]:
                raise _NoPrediction(Status.ERROR, f"{type(error).__name__}: {error}".splitlines()[0][:300]) from None
            why = "autocast" if isinstance(error, UsesAutocast) else type(error).__name__
            notes.append(f"{name} engine failed ({why}): ran on the {engines[engines.index(name) + 1]}")
    raise AssertionError("no engine to run")  # `_engines` never returns an empty list


def _replayed_step(case, spec: str, engine: str, strategy, ranks: int, notes: list[str], snapshot: bool,
                   capability: tuple[int, int] | None) -> TrackedStep | None:
    """The case's step by layer replay where it applies and is proven (its note added to `notes`), else None (where
    it applied but was refused, why, in `notes`)."""
    if layer_replay.why_not_replayable(case, strategy, ranks, engine, snapshot) is not None:
        return None
    if strategy.distributed:
        step, why = layer_replay_ranks.tracked_ranks_by_layers(case, spec, engine, MEMORY_WARMUP_STEPS["cuda"],
                                                               capability, ranks, strategy)
    else:
        step, why = layer_replay.tracked_step_by_layers(case, spec, engine, MEMORY_WARMUP_STEPS["cuda"], capability)
    if step is None:
        notes.append(f"layer replay refused ({why}): every layer traced")
        return None
    layers = layer_replay.layers_of_case(case)
    notes.append(layer_replay.replay_note(layers, layer_replay.layer_kinds(strategy, layers)))
    return step


def ranks_traced_note(traced: tuple[int, ...], ranks: int) -> str:
    """What a sharded row says when fewer ranks than `ranks` were traced (`fake_engine.tracked_step`)."""
    names = ", ".join(map(str, traced))
    return (f"rank{'s' if len(traced) > 1 else ''} {names} traced: the other {ranks - len(traced)} hold chunks and "
            "batch shares of the same sizes as one of them")


def _fill_figures(row: Row, step: TrackedStep, capability: tuple[int, int] | None, notes: list[str]) -> None:
    """The row's figures from the tracked step: on the CPU its peak; on CUDA its events replayed through the
    caching allocator's model with cuBLAS's workspaces, and what cuDNN's convolution workspaces may add."""
    if row["device"] != "cuda":
        row["predicted_bytes"] = step.peak_bytes
        row["predicted_mib"] = round(step.peak_bytes / MiB, 1)
        row.update(breakdown.predicted_columns(step.peak_by_category))
        _name_activation_parts(row, notes, step.peak_by_category)
        return
    workspace = cublas_workspace(capability or device_capability())
    replayed = cuda_allocator.replay(step.events, workspace)
    row.update(breakdown.predicted_columns(replayed.peak_by_category))
    _name_activation_parts(row, notes, replayed.peak_by_category)
    row.update(predicted_bytes=replayed.max_allocated_bytes, predicted_mib=round(replayed.max_allocated_bytes / MiB, 1),
               predicted_reserved_bytes=replayed.max_reserved_bytes,
               predicted_reserved_mib=round(replayed.max_reserved_bytes / MiB, 1),
               cublas_workspace_bytes=replayed.cublas_workspaces * workspace)
    scratch = getattr(step.tracker, "op_workspace", None)
    note = scratch.convolutions.note() if isinstance(scratch, OperatorScratch) else None
    if note is not None:
        row["cudnn_workspace_bytes"] = replayed.peak_by_category.get(memory_categories.CUDNN_WORKSPACE, 0)
        notes.append(note)
        row["message"] = "; ".join(notes)


def _name_activation_parts(row: Row, notes: list[str], peak_by_category: dict[str, int]) -> None:
    """The parts of the predicted activations a workload filed apart (an MoE layer's router and dispatch buffers,
    `breakdown.activation_parts`), added to the row's message."""
    parts = breakdown.activation_parts(peak_by_category)
    if parts:
        notes.append(parts)
        row["message"] = "; ".join(notes)


def _write_snapshot(case, row: Row, step: TrackedStep, capability: tuple[int, int] | None, folder: str) -> None:
    """The predicted step's snapshot: on CUDA the allocator model's blocks and segments (the replay that gave the
    row's figures), else the tracker's storages; for a sharded strategy, the largest rank's."""
    about = {"workload": case.workload, "strategy": row["strategy"], "phase": case.phase,
             "batch_size": case.batch_size, "data": case.data, "device": case.device, "kind": "predicted",
             "engine": step.engine, "peak_mem_bytes": row["predicted_bytes"],
             "peak_reserved_bytes": row.get("predicted_reserved_bytes"), "rank": None}
    if case.device == "cuda":
        taken = snapshot.allocator_snapshot(step.tracker, about, cublas_workspace(capability or device_capability()))
    else:
        taken = snapshot.tracker_snapshot(step.tracker, about)
    snapshot.write_snapshot(taken, Path(folder))


def progress_line(index: int, total: int, case, where: str = "") -> str:
    """The line predict prints as it starts a case (`where`: " on fake CUDA" in the fake-CUDA environment)."""
    return f"[{index + 1}/{total}] predicting {case.strategy} {case.phase} bs={case.batch_size}{where} ..."


def predict_cases(cases: list, engine: str = "auto", ranks: int = 1, capability: tuple[int, int] | None = None,
                  on_case: Callable[[int, object], None] | None = None, snapshot_dir: str | None = None) -> list[Row]:
    """`predict_case` for each case, in order; `on_case(index, case)` is called before each; with `snapshot_dir`,
    each case's predicted memory snapshot is written there.

    CUDA cases on `auto` or `fake-cuda` run on CUDA's own operators: in this process where its torch sees a CUDA
    device (a GPU, or the fake-CUDA environment's stubs), else in a subprocess of the fake-CUDA environment's Python
    (`bench.measure.fake_cuda`), which predicts them all and falls back, case by case, to the fake and cpu engines as
    this process would. Where that environment does not exist, `auto` is the fake engine and `fake-cuda` a UsageError
    saying why; where the subprocess fails, the cases are predicted here and each row says why."""
    if engine in CUDA_ONLY_ENGINES and any(case.device != "cuda" for case in cases):
        raise UsageError(f"--engine {engine}: predicts CUDA only; with --device cpu choose one of "
                         f"{', '.join(e for e in ENGINES if e not in CUDA_ONLY_ENGINES)}")
    replayable = [case.workload for case in cases if case.device == "cuda" and layer_replay.might_replay(case.workload)]
    if engine in ("auto", "fake-cuda") and replayable:
        # before anything asks torch about CUDA (is_available below included): a worker forked after that cannot use it
        proof_beside.stand_by(replayable[0])
    in_subprocess = (engine in ("auto", "fake-cuda") and any(case.device == "cuda" for case in cases)
                     and not torch.cuda.is_available())
    note = ""
    if in_subprocess:
        python = fake_cuda.environment_python()
        if python is None and engine == "fake-cuda":
            raise UsageError(f"--engine fake-cuda: {fake_cuda.unavailable_reason()}")
        if python is not None:
            rows, note = _predict_in_fake_cuda_environment(python, cases, engine, ranks, capability, snapshot_dir)
            if rows is not None:
                return rows
            engine = "auto"
    rows = []
    for index, case in enumerate(cases):
        if on_case is not None:
            on_case(index, case)
        with process_state():  # what a user's workload sets globally (its default dtype) stays in its case
            row = predict_case(case, engine, ranks, capability, snapshot_dir)
        if note and case.device == "cuda":
            row["message"] = "; ".join(x for x in (note, row["message"]) if x)
        rows.append(row)
    return rows


def predicted_specs(asked: list[str]) -> list[str]:
    """The strategies a prediction or a search over lengths (`predict`, `fit --over seq_len`) covers: those asked
    for, the baseline first where it is one of them; the baseline alone where none is named. The baseline is not
    added to strategies that did not ask for it: nothing in their tables is derived from its row, and at full size
    it costs as long as a strategy's prediction and seldom fits (`compare`, `fit` over batches and `plan` still
    include it: they verify or rank against it)."""
    asked = list(dict.fromkeys(asked))
    if not asked or "baseline" in asked:
        return ["baseline"] + [s for s in asked if s != "baseline"]
    return asked


def predicted_allocated(case, capability: tuple[int, int] | None = None) -> int | None:
    """The predicted `max_memory_allocated` of one CUDA case (`predict_cases`: on fake CUDA where it can), or None
    when the case has no prediction (unsupported, or no engine could run it); what `fit --device cuda` searches on
    without a GPU."""
    (row,) = predict_cases([case], capability=capability)
    return row["predicted_bytes"] if row["status"] == Status.OK.value else None


def _predict_in_fake_cuda_environment(python: Path, cases: list, engine: str, ranks: int,
                                      capability: tuple[int, int] | None,
                                      snapshot_dir: str | None = None) -> tuple[list[Row] | None, str]:
    """The cases' rows predicted by `python -m bench.analysis._predict_worker` in the fake-CUDA environment (its
    progress on this process's stderr), made back into rows of the predict table, or (None, why) when that process
    fails."""
    request = {"cases": [asdict(case) for case in cases], "engine": engine, "ranks": ranks,
               "capability": list(capability) if capability else None, "snapshot_dir": snapshot_dir}
    rows, why = run_in_fake_cuda(python, "bench.analysis._predict_worker", request)
    if rows is not None:
        return [PREDICT.row(values) for values in rows], ""
    return None, f"the fake-CUDA environment failed ({why[:200]}): predicted here"


