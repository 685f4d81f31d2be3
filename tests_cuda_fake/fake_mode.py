"""The test side of the fake-CUDA run: what the operators of membench's CUDA steps did, recorded under
`bench.measure.fake_cuda_mode.fake_cuda` (the mode itself, and what it changes in torch, is described there)."""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from bench.measure import fake_cuda_mode
from bench.measure.fake_cuda_mode import FakeAllocator, ScalerCalls


@dataclass
class OpRecord:
    """What `OpRecorder` saw: per operator, the devices of its tensors that have dimensions (0-dimensional host
    tensors are legitimate beside CUDA ones: Adam's step counters, Python numbers lifted to tensors) and the dtypes
    of its outputs."""

    devices: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    # the dtype of each operator's (first) output in the forward passes, where autocast applies
    forward_dtypes: dict[str, set[torch.dtype]] = field(default_factory=lambda: defaultdict(set))
    cudnn_benchmark: set[bool] = field(default_factory=set)  # the flag's values while convolutions ran
    calls: Counter = field(default_factory=Counter)


class OpRecorder(TorchDispatchMode):
    """Records every operator that reaches the fake mode below it (after autocast has cast its inputs) while
    `active`; `recording_steps()` makes it active inside the runner's steps only (not while models are built)."""

    def __init__(self, active: bool = True):
        super().__init__()
        self.record = OpRecord()
        self.active = active
        self.in_forward = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.active:
            return out
        name = func.overloadpacket.__name__
        self.record.calls[name] += 1
        inputs, _ = tree_flatten((args, kwargs))
        outputs, _ = tree_flatten(out)
        for t in inputs + outputs:
            if isinstance(t, torch.Tensor) and t.dim() > 0 and name != "device":  # prim::device reads no data
                self.record.devices[name].add(t.device.type)
        if self.in_forward and outputs and isinstance(outputs[0], torch.Tensor):
            self.record.forward_dtypes[name].add(outputs[0].dtype)
        if name.startswith(("convolution", "cudnn_convolution")):
            self.record.cudnn_benchmark.add(torch.backends.cudnn.benchmark)
        return out


@contextlib.contextmanager
def recording_steps(recorder: OpRecorder) -> Iterator[None]:
    """The recorder active only inside `bench.run.runner.Session.step` (the steps the runner times and measures), and
    told when the model's forward runs (`Session.forward`, inside the strategy's forward context)."""
    from bench.run.runner import Session

    step, forward = Session.step, Session.forward

    def flagged(method, flag: str):
        """`method`, with the recorder's `flag` True while it runs."""
        def wrapped(self, *args, **kwargs):
            setattr(recorder, flag, True)
            try:
                return method(self, *args, **kwargs)
            finally:
                setattr(recorder, flag, False)
        return wrapped

    Session.step, Session.forward = flagged(step, "active"), flagged(forward, "in_forward")
    try:
        yield
    finally:
        Session.step, Session.forward = step, forward


@contextlib.contextmanager
def fake_cuda(record: bool = False, allocator: FakeAllocator | None = None
              ) -> Iterator[tuple[ScalerCalls, OpRecord | None]]:
    """`bench.measure.fake_cuda_mode.fake_cuda`: (GradScaler's calls, the operators the runner's steps ran if `record`)."""
    recorder = OpRecorder(active=False) if record else None
    inner = [recorder, recording_steps(recorder)] if recorder is not None else []
    with fake_cuda_mode.fake_cuda(allocator, inner) as calls:
        yield calls, recorder.record if recorder is not None else None
