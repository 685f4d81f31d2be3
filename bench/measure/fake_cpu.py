"""What the CPU's own kernels allocate, on fake tensors: the storages of the operators whose meta kernels differ.

PyTorch's fake tensors run each operator's meta kernel: the right shapes and dtypes, but for a few CPU kernels not
the storage the CPU really returns. Counted by the exact live-tensor tracker, those are the only differences
between a step on fake tensors and the same step on the CPU (tests/test_emulated16.py checks every built-in
workload, float32 and 16-bit autocast, to the byte):
- the reduced losses `binary_cross_entropy`, `mse_loss`, `smooth_l1_loss` and `soft_margin_loss` compute their
  elementwise losses into the output, then `resize_` it to the reduced 0-d result (ATen's Loss.cpp): the returned
  scalar keeps a storage of the broadcast input's size (`CPU_LOSS_BUFFER_OPS`);
- `native_batch_norm` of a 16-bit input with float32 parameters (autocast: BatchNorm runs in the input's dtype
  with the module's float32 weights) saves its mean and inverse standard deviation in float32 (ATen's
  `batch_norm_cpu`, mixed types); the meta kernel in the input's dtype.

`CpuKernelStorages` is a dispatch mode, entered inside a FakeTensorMode and below the tracker, that replaces those
outputs by fake tensors with the CPU's storage. It changes nothing for tensors on another device.
Limitations: only the operators above are corrected; a workload with another such kernel shows as a difference
in that test.
"""

from __future__ import annotations

from typing import Any

import torch

from bench.measure.dispatch_modes import CompiledCodeMode

aten = torch.ops.aten

# reduced losses whose CPU kernel returns the 0-d result in the storage of the elementwise losses
CPU_LOSS_BUFFER_OPS = (aten.binary_cross_entropy.default, aten.mse_loss.default, aten.smooth_l1_loss.default,
                       aten.soft_margin_loss.default)
_REDUCTION_NONE = 0
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _argument(func, args: tuple, kwargs: dict, name: str, default: Any) -> Any:
    """An operator's argument by its schema name, positional or keyword."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            if index < len(args):
                return args[index]
            return kwargs.get(name, default)
    return default


def _loss_with_cpu_buffer(func, args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
    """The reduced loss in a storage of the broadcast input's elements, as the CPU kernel returns it."""
    if _argument(func, args, kwargs, "reduction", 1) == _REDUCTION_NONE:
        return out
    shape = torch.broadcast_shapes(args[0].shape, args[1].shape)
    buffer = torch.empty(shape, dtype=out.dtype, device=out.device)
    return buffer.resize_(out.shape)  # resize_ never shrinks a storage: the CPU's buffer stays


def _batch_norm_with_cpu_stats(func, args: tuple, kwargs: dict, out: tuple) -> tuple:
    """native_batch_norm's (output, save_mean, save_invstd), the saved statistics in the parameters' dtype where a
    16-bit input meets parameters of another dtype (the CPU kernel's mixed-type path)."""
    inputs = args[0]
    parameters = [t for t in args[1:5] if isinstance(t, torch.Tensor)]
    dtypes = {t.dtype for t in parameters}
    if inputs.dtype not in _LOW_PRECISION or len(dtypes) != 1 or inputs.dtype in dtypes:
        return out
    dtype = dtypes.pop()
    output, mean, invstd = out
    return output, *(torch.empty(t.shape, dtype=dtype, device=t.device) for t in (mean, invstd))


_CORRECTIONS = {**dict.fromkeys(CPU_LOSS_BUFFER_OPS, _loss_with_cpu_buffer),
                aten.native_batch_norm.default: _batch_norm_with_cpu_stats}


class CpuKernelStorages(CompiledCodeMode):
    """On fake CPU tensors, the outputs of the operators above as the CPU's kernels return them (see the module)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        correct = _CORRECTIONS.get(func)
        first = out[0] if isinstance(out, tuple) else out
        if correct is None or not isinstance(first, torch.Tensor) or first.device.type != "cpu":
            return out
        return correct(func, args, kwargs, out)
