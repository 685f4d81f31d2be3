"""cuDNN's convolution workspace: what each convolution call holds while it runs, from a table measured on a GPU.

On CUDA, PyTorch runs a convolution through cuDNN's v8 API (aten/src/ATen/native/cudnn/Conv_v8.cpp): with
cudnn.benchmark off it takes the engine configurations cuDNN's heuristics list, in their order, and runs the first
whose plan builds, allocating that plan's workspace through the caching allocator for the call's duration (counted
by max_memory_allocated, freed after it); with benchmark on, it times the candidates once and keeps the fastest.
Either way the plan is cached per shape, dtype, layout and alignment, so every later call of that convolution holds
the same workspace. Its size is the chosen engine's, not a function of the shapes one can write down: on an H200
(cuDNN 9.19) the workspace of a 3x3 convolution from 64 to 64 channels was about its input's bytes up to batch 64
and twice them from batch 100; some weight gradients took 140 MB at batch 16-25 and 25 MB at 32. Nothing caps it:
CUDNN_CONV_WSCAP_DBG (v7's) did not change one (results/reference/gpu/h200-20261130/). Where an allocation fails
PyTorch tries the next engine, so a workspace alone does not end a step out of memory on a card that is full.

So the workspace is predicted from measurement: `tables/cudnn_workspace_sm90_cudnn919.csv` holds, per convolution
call signature (pass, dtype, shapes, stride, padding, dilation, transposed, groups, gradients asked for, layout,
heuristics or benchmark), the bytes one call held beyond its outputs on that GPU (tools/gpu/conv_workspace.py: the
allocator's peak during the call less what it held after), for the CNNs of the reference runs at the batch sizes
they run. A convolution the table holds at other batch sizes only is estimated from them: between two measured
batch sizes, linearly (the workspace of the engines seen grows about linearly with the batch, between the batch
sizes where the heuristics switch engine); above the largest, in proportion to the batch; below the smallest, as
the smallest's. A convolution the table does not hold, or a GPU of another compute capability, is not modelled;
the prediction says how many calls were estimated and how many not modelled.
"""

from __future__ import annotations

import csv
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

CONVOLUTION_OPS = frozenset({"convolution", "convolution_backward"})
TABLES = {(9, 0): Path(__file__).parent / "tables" / "cudnn_workspace_sm90_cudnn919.csv"}
TABLE_SOURCE = "measured on an NVIDIA H200 (compute capability 9.0, cuDNN 9.19, torch 2.11)"


def _dims(values) -> str:
    return "x".join(str(int(v)) for v in values)


class ConvolutionCall(NamedTuple):
    """One call of aten.convolution ("forward") or aten.convolution_backward ("backward"), by its arguments."""

    kind: str
    grad_output: torch.Tensor | None
    data: torch.Tensor
    weight: torch.Tensor
    stride: list
    padding: list
    dilation: list
    transposed: bool
    groups: int
    mask: str  # the gradients asked for, as "110" (backward only)

    @property
    def channels_last(self) -> bool:
        data = self.data
        return data.dim() == 4 and not data.is_contiguous() and data.is_contiguous(memory_format=torch.channels_last)


def convolution_call(op: str, args: tuple) -> ConvolutionCall | None:
    """The call's arguments by name; None for an operator that is no convolution."""
    if op == "convolution_backward":
        stride, padding, dilation, transposed, _, groups = args[4:10]
        mask = "".join("1" if wanted else "0" for wanted in args[10])
        return ConvolutionCall("backward", args[0], args[1], args[2], stride, padding, dilation, bool(transposed),
                               int(groups), mask)
    if op == "convolution":
        stride, padding, dilation, transposed, _, groups = args[3:9]
        return ConvolutionCall("forward", None, args[0], args[1], stride, padding, dilation, bool(transposed),
                               int(groups), "")
    return None


def key(kind: str, dtype: str, input_shape: str, weight_shape: str, stride: str, padding: str, dilation: str,
        transposed: bool, groups: int, mask: str, channels_last: bool, benchmark: bool) -> str:
    """The table's key of a call, from its parts as text (shapes and parameters as "32x64x56x24")."""
    return "|".join([kind, dtype, input_shape, weight_shape, stride, padding, dilation, str(transposed).lower(),
                     str(groups), mask, "channels_last" if channels_last else "contiguous",
                     "benchmark" if benchmark else "heuristics"])


def signature(op: str, args: tuple) -> str | None:
    """The table's key of one call of aten.convolution or aten.convolution_backward, from its arguments; None for
    any other operator."""
    call = convolution_call(op, args)
    if call is None:
        return None
    return key(call.kind, str(call.data.dtype).removeprefix("torch."), _dims(call.data.shape), _dims(call.weight.shape),
               _dims(call.stride), _dims(call.padding), _dims(call.dilation), call.transposed, call.groups, call.mask,
               call.channels_last, torch.backends.cudnn.benchmark)


@functools.lru_cache(maxsize=None)
def _table(path: Path) -> dict[str, int]:
    with open(path, newline="") as handle:
        return {row["signature"]: int(row["workspace_bytes"]) for row in csv.DictReader(handle)}


def _without_batch(key: str) -> tuple[str, int]:
    """(the signature with its batch size left out, the batch size)."""
    kind, dtype, shape, rest = key.split("|", 3)
    batch, _, per_sample = shape.partition("x")
    return f"{kind}|{dtype}|{per_sample}|{rest}", int(batch)


@functools.lru_cache(maxsize=None)
def _by_batch(path: Path) -> dict[str, list[tuple[int, int]]]:
    """The table's calls by signature without the batch size: (batch size, bytes), by batch size."""
    batches: dict[str, list[tuple[int, int]]] = {}
    for key, nbytes in _table(path).items():
        rest, batch = _without_batch(key)
        batches.setdefault(rest, []).append((batch, nbytes))
    return {rest: sorted(measured) for rest, measured in batches.items()}


def estimated_from_other_batches(measured: list[tuple[int, int]], batch: int) -> int:
    """A call's workspace at `batch` from the same convolution's at other batch sizes (see the module's docstring)."""
    below = [point for point in measured if point[0] < batch]
    above = [point for point in measured if point[0] > batch]
    if below and above:
        (b0, w0), (b1, w1) = below[-1], above[0]
        return round(w0 + (w1 - w0) * (batch - b0) / (b1 - b0))
    if below:
        b0, w0 = below[-1]
        return round(w0 * batch / b0)
    return above[0][1]


@dataclass
class ConvolutionWorkspaces:
    """Sizes each convolution call's workspace for a GPU of `capability` (an operator and its arguments -> bytes,
    as `LiveTensorTracker.op_workspace` asks), counting the calls it found in its table and those it did not."""

    capability: tuple[int, int] | None
    found: int = 0
    estimated: int = 0
    missing: int = 0
    missing_signatures: set[str] = field(default_factory=set)

    def __call__(self, func, args: tuple) -> int:
        op = func.__name__.split(".")[0]
        if op not in CONVOLUTION_OPS:
            return 0
        key = signature(op, args)
        path = TABLES.get(tuple(self.capability)) if self.capability else None
        if path is None or key is None:
            self.missing += 1
            return 0
        nbytes = _table(path).get(key)
        if nbytes is not None:
            self.found += 1
            return nbytes
        rest, batch = _without_batch(key)
        measured = _by_batch(path).get(rest)
        if measured:
            self.estimated += 1
            return estimated_from_other_batches(measured, batch)
        self.missing += 1
        self.missing_signatures.add(key)
        return 0

    def note(self) -> str | None:
        """What the row's message says of cuDNN's workspaces; None where the step ran no convolution."""
        calls = self.found + self.estimated + self.missing
        if not calls:
            return None
        if self.capability is None or tuple(self.capability) not in TABLES:
            return (f"cuDNN conv workspace not modelled: measured for compute capability 9.0 only, not "
                    f"{'.'.join(map(str, self.capability)) if self.capability else 'this device'}")
        parts = [f"cuDNN conv workspaces per call {TABLE_SOURCE}"]
        if self.estimated:
            parts.append(f"{self.estimated} of {calls} calls estimated from the same convolution at other batch sizes")
        if self.missing:
            parts.append(f"{self.missing} of {calls} calls ({len(self.missing_signatures)} shapes) not in its table, "
                         "not modelled")
        return "; ".join(parts)
