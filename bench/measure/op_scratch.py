"""What CUDA operators hold while they run, beyond their outputs, for a prediction's tracker
(`LiveTensorTracker.op_workspace`): cuDNN's convolution workspaces (`bench.measure.cudnn_workspace`) and the
reduction kernel's scratch (`bench.measure.cuda_reduction`), each allocated after the call's outputs and freed when
it returns."""

from __future__ import annotations

from bench.core import memory_categories
from bench.measure.cuda_reduction import REDUCTIONS, ReductionScratch
from bench.measure.cudnn_workspace import CONVOLUTION_OPS, ConvolutionWorkspaces


class OperatorScratch:
    """An operator and its arguments -> the buffers it holds while it runs, (bytes, category) in allocation order, on
    a GPU of `capability`; `convolutions` counts the convolution calls for the row's note."""

    def __init__(self, capability: tuple[int, int] | None):
        self.convolutions = ConvolutionWorkspaces(capability)
        self.reductions = ReductionScratch(capability)
        self._sizer_of: dict = {}  # operator -> its sizer, or None (asked once per operator: a trace runs ~10^5)

    def __call__(self, func, args: tuple) -> tuple[tuple[int, str], ...]:
        sizer = self._sizer_of.get(func, False)
        if sizer is False:
            op = func.__name__.split(".")[0]
            sizer = self._sizer_of[func] = (self._convolution if op in CONVOLUTION_OPS else
                                            self._reduction if op in REDUCTIONS else None)
        return () if sizer is None else sizer(func, args)

    def _convolution(self, func, args: tuple) -> tuple[tuple[int, str], ...]:
        workspace = self.convolutions(func, args)
        return ((workspace, memory_categories.CUDNN_WORKSPACE),) if workspace else ()

    def _reduction(self, func, args: tuple) -> tuple[tuple[int, str], ...]:
        return tuple((nbytes, memory_categories.REDUCTION_SCRATCH) for nbytes in self.reductions(func, args))
