"""The fake-tensor memory pass: one tracked step on PyTorch's fake tensors (shapes, dtypes, autocast; no arithmetic).

`torch._subclasses.fake_tensor.FakeTensorMode` runs every operator's meta kernel on tensors that still say which
device they are on, so autocast applies (meta tensors ignore it) and the exact live-tensor tracker
(`bench.measure.memory.LiveTensorTracker`) counts the same storages as on the real device, in seconds at any batch size;
on the CPU `bench.measure.fake_cpu.CpuKernelStorages` gives the few operators whose CPU kernels return another storage
than their meta kernels the CPU's, so that the count equals a real CPU step's to the byte.
`FakeSession` is the runner's `Session` with its model and batch kept as fake tensors. The runner counts the memory
of a 16-bit case the CPU emulates with it (`bench.run.runner`); predict and fit (`bench.analysis.fake_engine`) too.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._pytree import tree_map

from bench.measure import memory
from bench.measure.fake_cpu import CpuKernelStorages
from bench.run.case import Case
from bench.run.passes import MemoryResult, memory_pass
from bench.run.session import Session
from strategies import Strategy


class FakeSession(Session):
    """A session whose model is built under the fake mode (fake parameters) and whose batch is a fake copy."""

    def __init__(self, case: Case, strategy: Strategy, observe_grads: bool = False, *, fake_mode: FakeTensorMode):
        self.fake_mode = fake_mode
        super().__init__(case, strategy, observe_grads)

    def place(self, value: Any) -> Any:
        """The model as built (its parameters are already fake: `Module.to` cannot swap fake parameters), or the
        batch converted to fake tensors on the case's device."""
        if isinstance(value, torch.nn.Module):
            real = [t for t in (*value.parameters(), *value.buffers()) if not isinstance(t, FakeTensor)]
            if real:
                raise RuntimeError(f"{len(real)} parameters or buffers were not built as fake tensors")
            return value
        return tree_map(self._fake, value)

    def load_host_batch(self) -> Any:
        """The real batch from the runner's cache (made outside the fake mode, so that the cache never holds fake
        tensors), as fake tensors."""
        with unset_fake_temporarily():
            batch = super().load_host_batch()
        return tree_map(self._fake, batch)

    def _fake(self, value: Any) -> Any:
        """A real tensor's fake copy (the same one each time: the fake mode memoizes it); anything else as is."""
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            return self.fake_mode.from_tensor(value)
        return value


def fake_memory_pass(case: Case, strategy: Strategy, tracker: memory.LiveTensorTracker | None = None,
                     cpu_kernels: bool = True, record_timeline: bool = False, record_snapshot: bool = False,
                     **options: Any) -> MemoryResult:
    """`bench.run.passes.memory_pass` on fake tensors (the case's device is the fake tensors' device): the tracked
    peak, breakdown and growth of one steady-state step, with its tracker; `options` are memory_pass's
    (warmup_steps, growth_steps, prepare). `cpu_kernels=False` leaves the meta kernels' storages as they are
    (predict's CUDA estimate on the CPU's operators); else on the CPU they are the CPU kernels' (`CpuKernelStorages`).
    """
    tracker = tracker or memory.LiveTensorTracker(case.device, record_timeline=record_timeline,
                                                  record_events=record_snapshot)
    with contextlib.ExitStack() as stack:
        mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        if cpu_kernels:
            stack.enter_context(CpuKernelStorages())
        return memory_pass(case, strategy, tracker=tracker,
                           session_class=functools.partial(FakeSession, fake_mode=mode), **options)
