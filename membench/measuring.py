"""`membench.measure`: the memory of each step of the user's own training loop, measured as membench measures its
own: the exact live tensor bytes on the CPU (bench.measure.memory's tracker), CUDA's allocator statistics on a GPU,
with the breakdown by category and, on request, a memory snapshot per step in `--snapshot`'s format."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from bench.measure import breakdown, memory, snapshot
from bench.core.units import MiB
from bench.run.preflight import check_choice, check_output_dir
from membench.workload import InputError, check_optimizer, parsed

# the breakdown's names -> bench.measure.breakdown's columns (the results table's peak_*_bytes)
BREAKDOWN = {"params": "peak_params_bytes", "grads": "peak_grads_bytes", "optimizer": "peak_optimizer_bytes",
             "activations": "peak_activations_bytes", "temp": "peak_temp_bytes", "batch": "peak_batch_bytes",
             "communication": "peak_communication_bytes"}


@dataclass
class StepMemory:
    """One measured step: `peak_bytes` (exact live tensor bytes on the CPU; torch.cuda.max_memory_allocated on
    CUDA), `reserved_bytes` (max_memory_reserved on CUDA, else None), the stage the peak was in, `breakdown` (bytes
    at the peak by category, from the exact tracker: params, grads, optimizer, activations, temp, batch,
    communication; they sum to the tracker's peak), and the snapshot file written for it, if any."""

    index: int
    peak_bytes: int
    reserved_bytes: int | None
    peak_stage: str
    breakdown: dict[str, int]
    tracked_peak_bytes: int
    snapshot: Path | None = None
    time_ms: float | None = None  # the step's wall time, where the caller timed it (the Trainer callback)

    def columns(self) -> dict[str, Any]:
        """The step as the results table's columns (peak_mem_bytes, peak_reserved_bytes, peak_stage, peak_*_bytes)."""
        return {"peak_mem_bytes": self.peak_bytes, "peak_reserved_bytes": self.reserved_bytes,
                "peak_stage": self.peak_stage, **{BREAKDOWN[k]: v for k, v in self.breakdown.items()}}


def _graph_task_id() -> int:
    """The id of the backward autograd's engine runs on this thread now, -1 outside one (PyTorch's private
    `torch._C._current_graph_task_id`, which activation checkpointing uses too; -1 where this torch lacks it)."""
    getter = getattr(torch._C, "_current_graph_task_id", None)
    return getter() if getter is not None else -1


class _LoopTracker(memory.LiveTensorTracker):
    """The exact tracker, told the stage of a loop it does not run: an operator run by autograd's engine is the
    backward, until the optimizer's step (forward pre-hooks and optimizer step hooks say the others), as membench's
    own loop marks its stages."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _graph_task_id() != -1:
            self.stage = "backward"
        return super().__torch_dispatch__(func, types, args, kwargs)


class _Loop:
    """What bench.measure.breakdown.prepare_breakdown asks of a session, for the user's model and optimizer."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None):
        self.model, self.optimizer = model, optimizer

    def parameters(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def optimizer_state(self) -> list[torch.Tensor]:
        if self.optimizer is None:
            return []
        return [v for state in self.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]

    def watch_grads(self, callback) -> "_Handles":
        return _Handles([p.register_post_accumulate_grad_hook(callback) for p in self.parameters() if p.requires_grad])


class _Handles:
    def __init__(self, handles: list):
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class Measurement:
    """Measures each step of a training loop the user runs: enter it (or `start()`), wrap each step in `step()`
    (or call `step_begin()` and `step_end()`), leave it (or `stop()`); `steps` holds a StepMemory per step.

    Example:
        >>> model = torch.nn.Linear(16, 4); opt = torch.optim.Adam(model.parameters())
        >>> x, y = torch.randn(8, 16), torch.randn(8, 4)
        >>> with measure(model, opt, batch=(x, y)) as m:
        ...     for _ in range(2):
        ...         with m.step():
        ...             loss = torch.nn.functional.mse_loss(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
        >>> len(m.steps), m.steps[0].breakdown["optimizer"], m.steps[1].breakdown["optimizer"] > 0  # Adam's state
        (2, 0, True)
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, batch: Any = None,
                 device: str | None = None, snapshot_dir: str | Path | None = None, name: str = "my_model"):
        if not isinstance(model, nn.Module):
            raise InputError(f"model: {type(model).__name__} is not a torch.nn.Module")
        if optimizer is not None:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise InputError(f"optimizer: {type(optimizer).__name__} is not a torch.optim.Optimizer")
            check_optimizer(optimizer, model)
        self.model, self.optimizer, self.batch = model, optimizer, batch
        first = next(iter(model.parameters()), None)
        self.device = parsed("device", check_choice, "device",
                             device or (first.device.type if first is not None else "cpu"), ("cpu", "cuda"), "device")
        self.snapshot_dir = (None if snapshot_dir is None else
                             parsed("snapshot_dir", check_output_dir, snapshot_dir, "snapshot_dir"))
        self.name = name
        self.steps: list[StepMemory] = []
        self._stack: contextlib.ExitStack | None = None
        self._step_stack: contextlib.ExitStack | None = None
        self._tracker: _LoopTracker | None = None

    # --- the whole loop ------------------------------------------------------------------------------------------
    def start(self) -> "Measurement":
        """Starts tracking: the model's parameters, buffers and gradients, the optimizer's state and `batch` exist
        from now on; every tensor made afterwards is counted as it is made."""
        if self._stack is not None:
            raise RuntimeError("this measurement has already started")
        tracker = self._tracker = _LoopTracker(self.device, record_events=self._tracker_snapshots())
        stack = self._stack = contextlib.ExitStack()
        stack.enter_context(tracker)
        stack.enter_context(snapshot.ModuleScope(self.model, tracker))
        loop = _Loop(self.model, self.optimizer)
        tracker.track(loop.parameters(), "params")
        tracker.track(self.model.buffers(), "buffers")
        tracker.track([p.grad for p in loop.parameters()], "grads")
        tracker.track(loop.optimizer_state(), "optimizer_state")
        tracker.track(_tensors(self.batch), "batch")
        handle = self.model.register_forward_pre_hook(lambda *args: setattr(tracker, "stage", "forward"))
        stack.callback(handle.remove)
        stack.enter_context(_backward_marked(tracker))
        if self.optimizer is not None:
            handle = self.optimizer.register_step_pre_hook(lambda *args: setattr(tracker, "stage", "optimizer"))
            stack.callback(handle.remove)
        return self

    def stop(self) -> None:
        """Stops tracking (a step begun and not ended is ended first)."""
        if self._step_stack is not None:
            self.step_end()
        if self._stack is not None:
            stack, self._stack = self._stack, None
            stack.close()

    def __enter__(self) -> "Measurement":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- one step ------------------------------------------------------------------------------------------------
    def step_begin(self) -> None:
        """A step begins: its peak starts from what is live now (as membench's memory pass starts its measured
        step: the state and gradients kept between steps filed as such)."""
        if self._stack is None:
            self.start()
        if self._step_stack is not None:
            raise RuntimeError("step_begin() twice without step_end()")
        tracker = self._tracker
        stack = self._step_stack = contextlib.ExitStack()
        stack.callback(breakdown.prepare_breakdown(_Loop(self.model, self.optimizer), tracker)[0].remove)
        tracker.stage = "setup"
        tracker.reset_peak()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            if self.snapshot_dir is not None:
                self._cuda_recording = stack.enter_context(snapshot.cuda_history({}))

    def step_end(self) -> StepMemory:
        """The step ends: its StepMemory, appended to `steps` (and its snapshot written, with `snapshot_dir`)."""
        if self._step_stack is None:
            raise RuntimeError("step_end() without step_begin()")
        tracker = self._tracker
        reserved = None
        if self.device == "cuda":
            torch.cuda.synchronize()
            allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        tracker.close_window()
        columns = breakdown.breakdown_columns(tracker)
        index = len(self.steps)
        step_stack, self._step_stack = self._step_stack, None
        step_stack.close()  # the grad watchers removed; on CUDA the recording ends here
        peak = allocated if self.device == "cuda" else tracker.peak_bytes
        step = StepMemory(index, int(peak), reserved, tracker.peak_stage,
                          {name: int(columns[column]) for name, column in BREAKDOWN.items()}, tracker.peak_bytes)
        if self.snapshot_dir is not None:
            step.snapshot = self._write_snapshot(step)
        self.steps.append(step)
        return step

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """A context manager around one step of the loop (`step_begin()`, then `step_end()` when it exits)."""
        self.step_begin()
        try:
            yield
        finally:
            self.step_end()

    def track_batch(self, value: Any) -> None:
        """Files the tensors in `value` (with at least one dimension) as the batch from now on: a batch the loop
        makes itself, after `start()` (the Trainer callback files the tensors each step hands the model)."""
        if self._tracker is not None:
            self._tracker.recategorize([t for t in _tensors(value) if t.dim()], "batch")

    @property
    def in_step(self) -> bool:
        """Whether a step has begun and not ended."""
        return self._step_stack is not None

    # --- results -------------------------------------------------------------------------------------------------
    @property
    def peak_bytes(self) -> int | None:
        """The largest peak of the steps measured so far (None before the first)."""
        return max((s.peak_bytes for s in self.steps), default=None)

    def summary(self) -> str:
        """One line per step: its peak (MiB) and what it is made of."""
        lines = []
        for s in self.steps:
            parts = ", ".join(f"{k} {v / MiB:,.1f}" for k, v in s.breakdown.items() if v)
            reserved = f", reserved {s.reserved_bytes / MiB:,.1f} MiB" if s.reserved_bytes is not None else ""
            lines.append(f"step {s.index + 1}: peak {s.peak_bytes:,} B ({s.peak_bytes / MiB:,.1f} MiB{reserved}, "
                         f"in {s.peak_stage}; {parts} MiB)")
        return "\n".join(lines)

    def _tracker_snapshots(self) -> bool:
        return self.snapshot_dir is not None and self.device != "cuda"

    def _about(self, step: StepMemory) -> dict[str, Any]:
        return {"workload": self.name, "strategy": f"step{step.index + 1}", "phase": "train", "batch_size": None,
                "data": None, "device": self.device, "kind": "measured", "peak_mem_bytes": step.peak_bytes,
                "rank": None}

    def _write_snapshot(self, step: StepMemory) -> Path:
        if self.device == "cuda":
            recorded = self._cuda_recording
            taken = {**recorded, "membench": {**recorded["membench"], **self._about(step)}}
        else:
            taken = snapshot.tracker_snapshot(self._tracker, self._about(step))
            self._forget_events()
        return snapshot.write_snapshot(taken, self.snapshot_dir)

    def _forget_events(self) -> None:
        """Drops the log of steps already written, but the allocation of each storage live now (the next step's
        snapshot opens with them): the log does not grow with the loop."""
        tracker = self._tracker
        live = {info.key for info in tracker._storages.values()}
        tracker.events = [e for e in tracker.events if e.kind in ("alloc", "category") and e.key in live]


def measure(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, batch: Any = None,
            device: str | None = None, snapshot_dir: str | Path | None = None, name: str = "my_model") -> Measurement:
    """A Measurement of the user's own loop over `model` and `optimizer` (see Measurement); `batch`: tensors that
    live across the steps (counted as the batch from the start; a batch made inside a step is counted as it is
    made); `device`: where the model is (default: its parameters'); `snapshot_dir`: a memory snapshot per step
    (PyTorch's format, as `--snapshot` writes; open it at https://pytorch.org/memory_viz).

    Example (a notebook cell):
        >>> model = torch.nn.Linear(4, 4); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> m = measure(model, opt).start()
        >>> with m.step():
        ...     model(torch.ones(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
        >>> m.stop(); m.steps[0].peak_bytes > 0
        True
    """
    return Measurement(model, optimizer, batch=batch, device=device, snapshot_dir=snapshot_dir, name=name)


@contextlib.contextmanager
def _backward_marked(tracker: memory.LiveTensorTracker) -> Iterator[None]:
    """While entered, `torch.autograd.backward` (what `loss.backward()` calls) sets the tracker's stage to backward
    before it starts: the gradient it seeds the backward with (`ones_like(loss)`) is made there, as in membench's
    loop, which marks the backward before calling it."""
    original = torch.autograd.backward

    def backward(*args, **kwargs):
        tracker.stage = "backward"
        return original(*args, **kwargs)

    torch.autograd.backward = backward
    try:
        yield
    finally:
        torch.autograd.backward = original


def _tensors(value: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
