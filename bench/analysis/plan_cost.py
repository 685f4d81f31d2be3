"""The planner's step-time estimate: each operator of a candidate's step (`bench.measure.op_cost`) against the
figures of the device planned for (a GPU of `bench.core.gpus`, or this CPU as measured), roofline style.

An operator takes the longer of its arithmetic (its FLOPs over the device's FLOPS for its kind and dtype) and its
memory traffic (its bytes over the memory bandwidth), plus a fixed cost per operator (kernel launch on a GPU,
dispatch on the CPU); a copy between host and device takes its bytes over the host link. Recomputation counts
because the recomputed operators run in the traced step; offload's copies count as host transfers.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.core.errors import Unsupported
from bench.core.gpus import GPU
from bench.measure.op_cost import CONV, MATMUL, MEMORY, TRANSFER, CpuSpeed, OpCost

ESTIMATOR = ("roofline per aten operator (own model): max(FLOPs / FLOPS of its kind and dtype, bytes / memory "
             "bandwidth) + a fixed cost per operator; host copies over the host link; FLOPs by "
             "torch.utils.flop_counter, recomputation included")
# a CUDA kernel launch and PyTorch's dispatch around it: a few microseconds (CUDA C++ Best Practices Guide,
# "kernel launch overhead"); the figure the estimate adds per operator on a GPU
GPU_OP_OVERHEAD_S = 5e-6


@dataclass(frozen=True)
class DeviceFigures:
    """What an estimate needs of a device: FLOPS per (kind, dtype) (None: no such arithmetic), memory bandwidth,
    host link (None: none, the CPU), the fixed cost per operator, and where the figures come from."""

    name: str
    flops: dict[tuple[str, str], float | None]
    bandwidth_bytes_per_s: float
    host_link_bytes_per_s: float | None
    op_overhead_s: float
    source: str

    def seconds(self, ops: list[OpCost]) -> float:
        """The estimated time of one step's operators; Unsupported when one computes in a dtype the device lacks."""
        total = 0.0
        for op in ops:
            if op.kind == TRANSFER:
                total += op.bytes / self.host_link_bytes_per_s if self.host_link_bytes_per_s else 0.0
                continue
            compute = 0.0
            if op.flops:
                peak = self.flops.get((op.kind, op.dtype), self.flops.get((op.kind, "float32")))
                if peak is None:
                    raise Unsupported(f"{self.name} has no {op.dtype} arithmetic")
                compute = op.flops / peak
            total += max(compute, op.bytes / self.bandwidth_bytes_per_s) + self.op_overhead_s
        return total


def gpu_figures(gpu: GPU) -> DeviceFigures:
    """A GPU's published peaks: the same FLOPS for matmuls and convolutions in each dtype."""
    flops = {(kind, dtype): gpu.flops(dtype) for kind in (MATMUL, CONV, MEMORY)
             for dtype in ("float32", "float16", "bfloat16")}
    return DeviceFigures(gpu.name, flops, gpu.bandwidth_bytes_per_s, gpu.host_link_bytes_per_s, GPU_OP_OVERHEAD_S,
                         f"published peaks ({gpu.source})")


def cpu_figures(speed: CpuSpeed, name: str = "this CPU") -> DeviceFigures:
    """This CPU's measured matmul and convolution speed per dtype, copy bandwidth and per-operator cost."""
    flops = dict(speed.flops)
    for (kind, dtype), value in speed.flops.items():
        flops.setdefault((MEMORY, dtype), value)
    return DeviceFigures(name, flops, speed.bandwidth_bytes_per_s, None, speed.op_overhead_s,
                         "measured here: 512x512 matmul, 3x3 convolution, 32 MiB copy, one-element add")


def to_json(figures: DeviceFigures) -> dict:
    """The figures as JSON (for the fake-CUDA worker)."""
    return {"name": figures.name, "flops": [[k, d, v] for (k, d), v in figures.flops.items()],
            "bandwidth_bytes_per_s": figures.bandwidth_bytes_per_s,
            "host_link_bytes_per_s": figures.host_link_bytes_per_s, "op_overhead_s": figures.op_overhead_s,
            "source": figures.source}


def from_json(values: dict) -> DeviceFigures:
    return DeviceFigures(values["name"], {(k, d): v for k, d, v in values["flops"]}, values["bandwidth_bytes_per_s"],
                         values["host_link_bytes_per_s"], values["op_overhead_s"], values["source"])
