"""The planner's step-time estimate: each operator of a candidate's step (`bench.measure.op_cost`) against the
figures of the device planned for (a GPU of `bench.core.gpus`, or this CPU as measured), roofline style, and each
collective of a sharded step against the link its group crosses.

An operator takes the longer of its arithmetic (its FLOPs over the device's FLOPS for its kind and dtype) and its
memory traffic (its bytes over the memory bandwidth), plus a fixed cost per operator (kernel launch on a GPU,
dispatch on the CPU); a copy between host and device takes its bytes over the host link. Recomputation counts
because the recomputed operators run in the traced step; offload's copies count as host transfers.

A collective takes NCCL's ring time (nccl-tests' doc/PERFORMANCE.md): a fixed latency plus its payload S times its
bus-bandwidth factor over the link, (n-1)/n for an all-gather, reduce-scatter or all-to-all of n ranks, 2(n-1)/n
for an all-reduce, 1 for a broadcast, reduce or send. The link is the GPU-to-GPU one (NVLink, or PCIe) where every
rank of its group is on one node, the ranks laid out as torchrun numbers them (`--gpus-per-node` consecutive ranks a
node), else the network's share of a GPU. Communication is added to the compute: no overlap is assumed, so a sharded
candidate's time is an upper bound (FSDP and DDP overlap much of theirs with the backward).
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.core.errors import Unsupported
from bench.core.gpus import COLLECTIVE_LATENCY_S, GB_PER_S, GPU, NETWORK_BYTES_PER_S
from bench.measure.op_cost import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BARRIER, COLLECTIVE, CONV, MATMUL, MEMORY,
                                   REDUCE_SCATTER, TRANSFER, CpuSpeed, OpCost)

ESTIMATOR = ("roofline per aten operator (own model): max(FLOPs / FLOPS of its kind and dtype, bytes / memory "
             "bandwidth) + a fixed cost per operator; host copies over the host link; FLOPs by "
             "torch.utils.flop_counter, recomputation included; plus each collective by NCCL's ring model "
             "(latency + payload x bus factor / link: the GPU link inside a node, the network across nodes), added "
             "without overlap (an upper bound)")
# a CUDA kernel launch and PyTorch's dispatch around it: a few microseconds (CUDA C++ Best Practices Guide,
# "kernel launch overhead"); the figure the estimate adds per operator on a GPU
GPU_OP_OVERHEAD_S = 5e-6


def bus_factor(collective: str, ranks: int) -> float:
    """What a collective of `ranks` ranks moves over each rank's link, per byte of its payload (nccl-tests' bus
    bandwidth factors: (n-1)/n, 2(n-1)/n for an all-reduce, 1 for a rooted one or a send); 0 on one rank."""
    if ranks <= 1 or collective == BARRIER:
        return 0.0
    if collective in (ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL):
        return (ranks - 1) / ranks
    if collective == ALL_REDUCE:
        return 2 * (ranks - 1) / ranks
    return 1.0  # broadcast, reduce, gather, scatter, send, receive: the whole payload through one rank's link


def nodes_spanned(group_ranks: tuple[int, ...], gpus_per_node: int) -> int:
    """How many nodes a group's ranks sit on, `gpus_per_node` consecutive ranks a node (torchrun's numbering)."""
    return len({rank // gpus_per_node for rank in group_ranks})


@dataclass(frozen=True)
class DeviceFigures:
    """What an estimate needs of a device: FLOPS per (kind, dtype) (None: no such arithmetic), memory bandwidth,
    host link (None: none, the CPU), the fixed cost per operator, the link to a device of the same node and the
    network's share of a device (one direction each), a collective's fixed latency, and where the figures come
    from."""

    name: str
    flops: dict[tuple[str, str], float | None]
    bandwidth_bytes_per_s: float
    host_link_bytes_per_s: float | None
    op_overhead_s: float
    source: str
    peer_link_bytes_per_s: float
    network_bytes_per_s: float
    collective_latency_s: float

    def compute_seconds(self, ops: list[OpCost]) -> float:
        """The estimated time of one step's operators but its collectives; Unsupported when one computes in a
        dtype the device lacks."""
        total = 0.0
        for op in ops:
            if op.kind == COLLECTIVE:
                continue
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

    def collective_seconds(self, op: OpCost, gpus_per_node: int) -> float:
        """One collective's ring time: latency + payload x bus factor / link (module docstring); 0 on one rank."""
        ranks = len(op.group_ranks)
        if ranks <= 1:
            return 0.0
        link = self.peer_link_bytes_per_s if nodes_spanned(op.group_ranks, gpus_per_node) == 1 \
            else self.network_bytes_per_s
        return self.collective_latency_s + op.bytes * bus_factor(op.collective, ranks) / link

    def communication_seconds(self, ops: list[OpCost], gpus_per_node: int) -> float:
        """The estimated time of one step's collectives, one after another (`collective_seconds`)."""
        return sum(self.collective_seconds(op, gpus_per_node) for op in ops if op.kind == COLLECTIVE)

    def seconds(self, ops: list[OpCost], gpus_per_node: int = 8) -> float:
        """The estimated time of one step: its compute and its collectives, not overlapped (an upper bound);
        `gpus_per_node` as `plan --gpus-per-node` (default 8)."""
        return self.compute_seconds(ops) + self.communication_seconds(ops, gpus_per_node)


def gpu_figures(gpu: GPU) -> DeviceFigures:
    """A GPU's published peaks: the same FLOPS for matmuls and convolutions in each dtype; its link to the node's
    other GPUs, and the network's share of it between nodes."""
    flops = {(kind, dtype): gpu.flops(dtype) for kind in (MATMUL, CONV, MEMORY)
             for dtype in ("float32", "float16", "bfloat16")}
    link = "NVLink" if gpu.nvlink_bytes_per_s else "PCIe"
    return DeviceFigures(gpu.name, flops, gpu.bandwidth_bytes_per_s, gpu.host_link_bytes_per_s, GPU_OP_OVERHEAD_S,
                         f"published peaks ({gpu.source}); GPU to GPU {gpu.peer_link_bytes_per_s / GB_PER_S:g} GB/s "
                         f"each way ({link}) inside a node, {NETWORK_BYTES_PER_S / GB_PER_S:g} GB/s a GPU between "
                         f"nodes (one 400 Gb/s NIC a GPU), {COLLECTIVE_LATENCY_S * 1e6:g} us a collective",
                         gpu.peer_link_bytes_per_s, NETWORK_BYTES_PER_S, COLLECTIVE_LATENCY_S)


def cpu_figures(speed: CpuSpeed, name: str = "this CPU") -> DeviceFigures:
    """This CPU's measured matmul and convolution speed per dtype, copy bandwidth and per-operator cost. Its ranks
    are processes of this machine: their link is its measured copy bandwidth (the network's and the collective's
    latency are the GPUs' defaults, not measured)."""
    flops = dict(speed.flops)
    for (kind, dtype), value in speed.flops.items():
        flops.setdefault((MEMORY, dtype), value)
    return DeviceFigures(name, flops, speed.bandwidth_bytes_per_s, None, speed.op_overhead_s,
                         "measured here: 512x512 matmul, 3x3 convolution, 32 MiB copy (also the ranks' link), "
                         "one-element add", speed.bandwidth_bytes_per_s, NETWORK_BYTES_PER_S, COLLECTIVE_LATENCY_S)


def to_json(figures: DeviceFigures) -> dict:
    """The figures as JSON (for the fake-CUDA worker)."""
    return {"name": figures.name, "flops": [[k, d, v] for (k, d), v in figures.flops.items()],
            "bandwidth_bytes_per_s": figures.bandwidth_bytes_per_s,
            "host_link_bytes_per_s": figures.host_link_bytes_per_s, "op_overhead_s": figures.op_overhead_s,
            "source": figures.source, "peer_link_bytes_per_s": figures.peer_link_bytes_per_s,
            "network_bytes_per_s": figures.network_bytes_per_s,
            "collective_latency_s": figures.collective_latency_s}


def from_json(values: dict) -> DeviceFigures:
    return DeviceFigures(values["name"], {(k, d): v for k, d, v in values["flops"]}, values["bandwidth_bytes_per_s"],
                         values["host_link_bytes_per_s"], values["op_overhead_s"], values["source"],
                         values["peer_link_bytes_per_s"], values["network_bytes_per_s"],
                         values["collective_latency_s"])
