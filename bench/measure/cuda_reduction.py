"""The scratch CUDA's reduction kernel allocates while it runs: where a sum splits each output's inputs across thread
blocks, the blocks' partial results and a semaphore per column of blocks, from the caching allocator.

aten/src/ATen/native/cuda/Reduce.cuh (`gpu_reduce_kernel`, `setReduceConfig`, `ReduceConfig.global_memory_size`)
runs sum, mean, prod, amax and amin. It lays the iteration out as TensorIterator does (reduced dimensions first, each
group by stride, adjacent dimensions merged), maps a thread block's x to the fastest-moving dimension, and when each
output has many inputs and the outputs are few beside the GPU's thread blocks, it splits each output's inputs across
`ctas_per_output` blocks, which then need `acc_size x outputs x ctas_per_output` bytes (times the block's width and
output vector where the block does not reduce along x) and `4 x grid.x` bytes of semaphores for the duration of the
call. The bias gradient of a Linear layer (a sum over the batch and sequence of a (tokens, features) gradient) is the
common case: on an H200, gpt_mini's `sum` over 4,096 tokens of 1,536 bfloat16 features allocated 50,331,648 bytes
(4 x 1,536 x 64 blocks x 32 x 4) and 48 bytes of semaphores, exactly as this module computes
(results/reference/gpu/h200-20261130/).

The size depends on the GPU's multiprocessors and threads per multiprocessor, read from the device torch sees when
it is of the predicted compute capability, else from the flagship of that capability (`DEVICES`).
"""

from __future__ import annotations

import math

import torch

# operator -> whether its accumulator is the input's dtype (amax, amin) or the wider one (sum, mean, prod)
REDUCTIONS = {"sum": False, "mean": False, "prod": False, "amax": True, "amin": True}
MAX_NUM_THREADS = 512
WARP_SIZE = 32
VT0 = 4  # values a thread loads at once (Reduce.cuh's vt0 and input_vec_size)
# compute capability -> (multiprocessors, threads per multiprocessor) of the flagship GPU of that capability
DEVICES = {(7, 0): (80, 2048), (7, 5): (40, 1024), (8, 0): (108, 2048), (8, 6): (84, 1536), (8, 7): (16, 1536),
           (8, 9): (128, 1536), (9, 0): (132, 2048), (10, 0): (148, 2048), (10, 3): (148, 2048),
           (12, 0): (170, 1536)}


def _last_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def device_figures(capability: tuple[int, int] | None) -> tuple[int, int] | None:
    """(multiprocessors, threads per multiprocessor) of a GPU of `capability`: the device torch sees if it has that
    capability, else `DEVICES`'; None for a capability neither knows."""
    if capability is None:
        return None
    if torch.cuda.is_available() and torch.cuda.get_device_capability(0) == tuple(capability):
        props = torch.cuda.get_device_properties(0)
        threads = getattr(props, "max_threads_per_multi_processor", None)
        if threads:
            return props.multi_processor_count, threads
    return DEVICES.get(tuple(capability))


def _iteration(shape: list[int], strides: list[int], reduced: set[int]) -> tuple[list[int], list[int], int]:
    """TensorIterator's layout of a reduction of a tensor (`shape`, `strides` in elements) over `reduced`: the
    merged dimensions' sizes and input strides, reduced ones first, and how many are reduced."""
    dims = [d for d in range(len(shape)) if shape[d] != 1]
    kept = [d for d in dims if d not in reduced]
    out_strides = {d: math.prod(shape[k] for k in kept if k > d) for d in kept}  # a fresh contiguous output
    order = sorted((d for d in dims if d in reduced), key=lambda d: strides[d]) + sorted(
        kept, key=lambda d: out_strides[d])
    merged: list[list[int]] = []  # [size, input stride, output stride, reduced]
    for d in order:
        entry = [shape[d], strides[d], 0 if d in reduced else out_strides[d], d in reduced]
        last = merged[-1] if merged else None
        if (last is not None and last[3] == entry[3] and last[1] * last[0] == entry[1]
                and last[2] * last[0] == entry[2]):
            last[0] *= entry[0]
        else:
            merged.append(entry)
    return [m[0] for m in merged], [m[1] for m in merged], sum(1 for m in merged if m[3])


def scratch_bytes(shape, strides, reduced_dims, acc_size: int, device: tuple[int, int]) -> tuple[int, ...]:
    """The bytes `gpu_reduce_kernel` allocates while it runs for a reduction of a tensor of `shape` and `strides`
    (elements) over `reduced_dims` (all when empty) with an accumulator of `acc_size` bytes, on a GPU of `device`
    (multiprocessors, threads per multiprocessor): (the blocks' partial results, their semaphores), or () where each
    output is reduced within one thread block."""
    shape, strides = list(shape), list(strides)
    ndim = len(shape)
    reduced = {d % ndim for d in reduced_dims} if reduced_dims else set(range(ndim))
    sizes, in_strides, num_reduce_dims = _iteration(shape, strides, reduced)
    numel = math.prod(shape)
    if numel == 0 or not sizes:
        return ()
    num_outputs = math.prod(sizes[num_reduce_dims:])
    num_inputs = numel // num_outputs
    on_fastest = num_reduce_dims == len(sizes) or in_strides[0] < in_strides[num_reduce_dims]
    if on_fastest:
        dim0, dim1 = num_inputs, num_outputs
        fastest_stride = in_strides[0]
    else:
        dim0, dim1 = num_outputs, num_inputs
        fastest_stride = in_strides[num_reduce_dims]
    output_vec_size = 1
    if fastest_stride == 1:
        if on_fastest and dim0 > 128 and num_reduce_dims == 1:
            dim0 //= VT0  # vectorised along the input
        elif not on_fastest:
            output_vec_size = 4  # the output's size and the input's other strides divisible by it
            for stride in [sizes[num_reduce_dims]] + [s for i, s in enumerate(in_strides) if i != num_reduce_dims]:
                while stride % output_vec_size:
                    output_vec_size //= 2
            dim0 //= output_vec_size
    max_threads = MAX_NUM_THREADS // output_vec_size
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    block_width = min(dim0_pow2, WARP_SIZE)
    block_height = min(dim1_pow2, max_threads // block_width)
    block_width = min(dim0_pow2, max_threads // block_height)
    num_threads = block_width * block_height
    step_input = step_output = 1
    block_x_reduce = on_fastest
    if on_fastest:
        step_input *= block_width
    else:
        step_output *= block_width
    values_per_thread = _div_up(num_inputs, step_input)
    if values_per_thread >= min(block_height * 16, 256):
        step_input *= block_height
        block_y_reduce = True
    else:
        step_output *= block_height
        block_y_reduce = False
    values_per_thread = _div_up(num_inputs, step_input)
    multiprocessors, threads_per_mp = device
    target_grid = multiprocessors * (threads_per_mp // num_threads)
    grid_x = _div_up(num_outputs // output_vec_size, step_output)
    if not (block_y_reduce and values_per_thread >= 256 and grid_x <= target_grid):
        return ()
    ctas_per_output = max(min(_div_up(target_grid, grid_x), _div_up(values_per_thread, 16)),
                          _div_up(values_per_thread, 256))
    if ctas_per_output <= 1:
        return ()
    partials = acc_size * num_outputs * ctas_per_output * (1 if block_x_reduce else block_width * output_vec_size)
    return partials, 4 * grid_x


def accumulator_bytes(op: str, dtype: torch.dtype) -> int:
    """The bytes of `op`'s accumulator for an input of `dtype` (Reduce.cuh's arg_t)."""
    if REDUCTIONS[op]:
        return dtype.itemsize
    if dtype.is_floating_point:
        return 8 if dtype == torch.float64 else 4
    return 8  # integers and bool sum into int64


class ReductionScratch:
    """Sizes the scratch of each reduction call on a GPU of `capability` (an operator and its arguments -> bytes, as
    `LiveTensorTracker.op_workspace` asks)."""

    def __init__(self, capability: tuple[int, int] | None):
        self.device = device_figures(capability)

    def __call__(self, func, args: tuple) -> tuple[int, ...]:
        op = func.__name__.split(".")[0]
        if op not in REDUCTIONS or self.device is None or not args or not isinstance(args[0], torch.Tensor):
            return ()
        data = args[0]
        if data.dim() == 0 or data.is_complex():
            return ()
        dims = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else []
        if len(args) > 1 and isinstance(args[1], int):
            dims = [args[1]]
        return scratch_bytes(data.shape, data.stride(), dims, accumulator_bytes(op, data.dtype), self.device)
