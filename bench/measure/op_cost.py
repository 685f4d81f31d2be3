"""What each operator of a training step costs, counted while the step runs (on fake tensors too): FLOPs by
PyTorch's own formulas (`torch.utils.flop_counter`), bytes read and written, bytes moved between devices, and each
collective of a sharded step with its payload and its group; and the CPU's measured speed to turn them into seconds.

`OperatorCostCounter` is a TorchDispatchMode: entered around a step (a strategy's `session()`), it records one
`OpCost` per operator and cuts the records into steps where the step ends. `measure_cpu_speed()` times a matmul,
a convolution and a copy on this CPU in each dtype, in a second or two, so that an estimate on the CPU is
calibrated by what this CPU does, emulated 16-bit arithmetic included.

A collective (`COLLECTIVE`) is an operator of torch.distributed's dispatcher namespaces as it arrives under PyTorch's
fake process group: `c10d.*` (what `dist.all_gather_into_tensor`, `dist.all_reduce`, ... issue: FSDP2's all-gathers
and reduce-scatters, the ZeRO mechanism's, ZeroRedundancyOptimizer's broadcasts, DDP's bucket all-reduces as
`strategies.framework.sharding.data_parallel` issues them there) and `_c10d_functional.*` (DTensor's, tensor
parallelism's). Its record names the collective (ALL_GATHER, ...), its payload (nccl-tests' size S: the whole
array, the all-gather's output, the reduce-scatter's input) and its group's global ranks, which decide the link it
crosses (`bench.analysis.plan_cost`). Waiting on one (`wait_tensor`) runs no kernel and is not recorded.

Limitations: bytes are the sizes of the operator's tensor inputs and outputs (what a kernel that reads each input
once and writes each output once moves); caches, fusion and views are not modelled (a view moves nothing).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from bench.core.quiet_import import quiet_loggers
from bench.measure.dispatch_modes import CompiledCodeMode

with quiet_loggers("torch.utils.flop_counter"):  # a CUDA torch without triton warns; membench runs no triton kernel
    from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten

# operator kinds, by what bounds them: matrix units (matmul, attention), convolutions, memory, the host link, or the
# link between ranks
MATMUL, CONV, MEMORY, TRANSFER, COLLECTIVE = "matmul", "conv", "memory", "transfer", "collective"
# the collectives, as nccl-tests' doc/PERFORMANCE.md names them (each has its bus-bandwidth factor there);
# POINT_TO_POINT is a send or receive (its payload over the link once), BARRIER moves nothing
ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL = "all_gather", "reduce_scatter", "all_reduce", "all_to_all"
BROADCAST, REDUCE, POINT_TO_POINT, BARRIER = "broadcast", "reduce", "point_to_point", "barrier"
# the dispatcher's collective operators (torch 2.13) by name, trailing `_` (in place) dropped; an operator of these
# namespaces that names a process group but is not listed counts as POINT_TO_POINT (its payload over the link once)
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor")
COLLECTIVE_OPERATORS = {
    **dict.fromkeys(("_allgather_base", "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced",
                     "all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced"),
                    ALL_GATHER),
    **dict.fromkeys(("_reduce_scatter_base", "reduce_scatter", "reduce_scatter_tensor_coalesced",
                     "reduce_scatter_tensor", "reduce_scatter_tensor_out"), REDUCE_SCATTER),
    **dict.fromkeys(("allreduce", "allreduce_coalesced", "all_reduce", "all_reduce_coalesced"), ALL_REDUCE),
    **dict.fromkeys(("alltoall", "alltoall_base", "all_to_all_single", "shard_dim_alltoall"), ALL_TO_ALL),
    "broadcast": BROADCAST, "reduce": REDUCE, "gather": REDUCE, "scatter": BROADCAST,
    **dict.fromkeys(("send", "recv", "recv_any_source", "isend", "irecv", "batch_p2p_ops"), POINT_TO_POINT),
    **dict.fromkeys(("barrier", "monitored_barrier"), BARRIER),
}
_CONV_PACKETS = {aten.convolution, aten._convolution, aten.convolution_backward, aten.cudnn_convolution,
                 aten.convolution_overrideable, aten._slow_conv2d_forward}


def _cpu_flash_attention(query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_attention_backward(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


# the CPU's fused attention, which torch.utils.flop_counter does not list (it lists CUDA's)
_EXTRA_FORMULAS = {}
for _name, _formula in (("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_attention),
                        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_flash_attention_backward)):
    if hasattr(aten, _name):
        _EXTRA_FORMULAS[getattr(aten, _name)] = _formula


@dataclass(frozen=True)
class OpCost:
    """One operator call: its kind (MATMUL, CONV, MEMORY, TRANSFER, COLLECTIVE), the dtype of its arithmetic, its
    FLOPs and the bytes it reads and writes (for TRANSFER, the bytes copied between devices; for COLLECTIVE, its
    payload: nccl-tests' size S). A collective also names which (`collective`: ALL_GATHER, ...) and the global ranks
    of its group (`group_ranks`)."""

    kind: str
    dtype: str
    flops: int
    bytes: int
    collective: str = ""
    group_ranks: tuple[int, ...] = ()


def _process_group(value: Any):
    """The process group a collective's argument names: a ProcessGroup boxed for the dispatcher (`c10d.*`), or a
    group's registered name (`_c10d_functional.*`); None for anything else."""
    import torch.distributed as dist

    if isinstance(value, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(value)
    if isinstance(value, torch.ScriptObject) and value._type().qualified_name().endswith(".ProcessGroup"):
        return dist.ProcessGroup.unbox(value)
    return None


def collective_cost(func, args: tuple, kwargs: dict, out: Any,
                    group_ranks: dict[str, tuple[int, ...]] | None = None) -> OpCost | None:
    """The record of `func` when it is a collective of torch.distributed (module docstring): its payload is the
    largest of its buffers, an argument's tensors or its result (the all-gather's output, the reduce-scatter's input,
    the all-reduced tensors); None for any other operator, and for one of those namespaces that names no process
    group (`wait_tensor`, autograd's wrapper: no kernel). `group_ranks` caches each group's ranks by its name (valid
    within one process group's life: the next rank traced in this process names its groups alike)."""
    if func.namespace not in COLLECTIVE_NAMESPACES:
        return None
    import torch.distributed as dist

    named = dict(kwargs)
    named.update((argument.name, value) for argument, value in zip(func._schema.arguments, args))
    group = None
    for key in ("process_group", "group_name"):
        if named.get(key) is not None:
            group = _process_group(named[key])
            break
    if group is None:
        return None
    name = func._schema.name.split("::")[-1].rstrip("_")
    cache = {} if group_ranks is None else group_ranks
    ranks = cache.get(group.group_name)
    if ranks is None:
        ranks = cache[group.group_name] = tuple(dist.get_process_group_ranks(group))
    payload = max((_nbytes(_tensors(value)) for value in (*named.values(), out)), default=0)
    dtype = _dtype_name(_tensors((args, out)))
    return OpCost(COLLECTIVE, dtype, 0, payload, COLLECTIVE_OPERATORS.get(name, POINT_TO_POINT), ranks)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _local_shards(value: Any) -> Any:
    """`value` with each DTensor replaced by this rank's shard of it: a dispatch mode sees a DTensor's operator at
    the global shape, before DTensor runs it on the local shards (without the mode), and a rank computes and moves
    only its shards (tensor parallelism's projections: 1/T of the FLOPs)."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)  # none made before its import
    if dtensor is None:
        return value
    return tree_map(lambda t: t._local_tensor if isinstance(t, dtensor) else t, value)


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _dtype_name(tensors: list[torch.Tensor]) -> str:
    floating = [t.dtype for t in tensors if t.is_floating_point()]
    return str(floating[0]).removeprefix("torch.") if floating else "float32"


class OperatorCostCounter(CompiledCodeMode):
    """Records the cost of every operator run under it; `end_step()` closes a step (`steps` holds each step's
    list of OpCost). Views, and operators on no tensor, cost nothing."""

    def __init__(self):
        super().__init__()
        self.current: list[OpCost] = []
        self.steps: list[list[OpCost]] = []
        self.group_ranks: dict[str, tuple[int, ...]] = {}  # a counter counts one rank's steps: its groups stay

    def end_step(self) -> None:
        self.steps.append(self.current)
        self.current = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or func.overloadpacket in (aten.detach, aten.lift_fresh, aten.alias):
            return out
        if func.namespace in COLLECTIVE_NAMESPACES:  # never a kernel of arithmetic or memory traffic
            collective = collective_cost(func, args, kwargs, out, self.group_ranks)
            if collective is not None:
                self.current.append(collective)
            return out
        result = out
        args, kwargs, out = _local_shards((args, kwargs, out))
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        if not outputs:  # metadata (a fake tensor's `.device`), a scalar read: no kernel to speak of
            return result
        packet = func.overloadpacket
        formula = flop_registry.get(packet) or _EXTRA_FORMULAS.get(packet)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        dtype = _dtype_name(inputs or outputs)
        devices = {t.device.type for t in inputs + outputs}
        if packet in (aten._to_copy, aten.copy_) and len(devices) > 1:
            self.current.append(OpCost(TRANSFER, dtype, 0, _nbytes(outputs)))
            return result
        kind = CONV if packet in _CONV_PACKETS else (MATMUL if flops else MEMORY)
        self.current.append(OpCost(kind, dtype, flops, _nbytes(inputs) + _nbytes(outputs)))
        return result


def step_totals(ops: list[OpCost]) -> dict[str, int]:
    """A step's FLOPs, bytes read and written, bytes moved between devices, its collectives' payload, and operator
    count."""
    return {"flops": sum(op.flops for op in ops),
            "bytes": sum(op.bytes for op in ops if op.kind not in (TRANSFER, COLLECTIVE)),
            "transfer_bytes": sum(op.bytes for op in ops if op.kind == TRANSFER),
            "collective_bytes": sum(op.bytes for op in ops if op.kind == COLLECTIVE),
            "ops": len(ops)}


# --- the CPU's measured speed ------------------------------------------------------------------------------

def _best_seconds(work, repeats: int = 3) -> float:
    work()  # the first call pays for oneDNN's kernel choice and the allocations
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


@dataclass(frozen=True)
class CpuSpeed:
    """This CPU's measured speed: FLOPS per (kind, dtype) for matmuls and convolutions, copy bandwidth, and the
    cost of one small operator (dispatch overhead)."""

    flops: dict[tuple[str, str], float]
    bandwidth_bytes_per_s: float
    op_overhead_s: float


def measure_cpu_speed(dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> CpuSpeed:
    """Times a 512x512 matmul and a 3x3 convolution (32 x 64 channels x 28 x 28) in each dtype, a 32 MiB copy and
    a one-element add, best of three each after one warm-up: about a second, longer where 16-bit is emulated."""
    flops: dict[tuple[str, str], float] = {}
    with torch.no_grad():
        for name in dtypes:
            dtype = getattr(torch, name)
            a, b = torch.randn(512, 512, dtype=dtype), torch.randn(512, 512, dtype=dtype)
            flops[(MATMUL, name)] = 2 * 512**3 / _best_seconds(lambda: torch.mm(a, b))
            x = torch.randn(32, 64, 28, 28, dtype=dtype)
            w = torch.randn(64, 64, 3, 3, dtype=dtype)
            conv_flops = 2 * 32 * 64 * 28 * 28 * 64 * 9
            flops[(CONV, name)] = conv_flops / _best_seconds(lambda: torch.nn.functional.conv2d(x, w, padding=1))
        source = torch.empty(8 * 2**20, dtype=torch.float32)
        target = torch.empty_like(source)
        bandwidth = 2 * source.nbytes / _best_seconds(lambda: target.copy_(source))
        one, other = torch.ones(1), torch.ones(1)

        def small_ops():
            for _ in range(200):
                torch.add(one, other)
        overhead = _best_seconds(small_ops) / 200
    return CpuSpeed(flops, bandwidth, overhead)
