"""cuDNN autotuning: `torch.backends.cudnn.benchmark = True` for the case, restored afterwards."""

import contextlib

import torch

from strategies import Strategy, register_strategy


@register_strategy
class CudnnBenchmark(Strategy):
    """Lets cuDNN try its convolution algorithms and keep the fastest (its workspace may cost memory).

    CUDA only: on the CPU the row is `unsupported`. Exact to float tolerance (algorithms differ only in the order of
    float sums). The previous flag value is restored when the session ends, even on an exception.

    Limitations: CUDA only. Its cost in memory is cuDNN's convolution workspaces, which `predict` does
    not model: the measured `max_memory_allocated` can exceed a prediction by the workspace of the convolution running
    at the peak, and the autotuning's trial workspaces in the warm-up steps can stay in reserved memory
    (`bench.analysis.predict_assumptions`). The planner never tries it (`plan_excluded`).
    """

    name = "cudnn_benchmark"
    keeps_training_state = True
    description = "torch.backends.cudnn.benchmark = True (autotuned convolution algorithms)"
    devices = ("cuda",)
    priority = 10
    plan_excluded = ("chooses cuDNN algorithms by timing them on the GPU: neither their workspaces nor their speed can "
                     "be predicted")

    @contextlib.contextmanager
    def session(self):
        previous = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = True
        try:
            yield
        finally:
            torch.backends.cudnn.benchmark = previous
