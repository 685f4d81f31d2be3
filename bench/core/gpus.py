"""A table of common GPUs (memory, dense FLOPS per dtype, memory bandwidth, host link, GPU-to-GPU link) that `python -m
bench plan --gpu NAME` plans for, the network between nodes and a collective's latency that a sharded plan's step time
counts, and the CUDA context every process pays on top of what PyTorch allocates.

The figures are the vendors' published peak figures for dense arithmetic (no 2:4 sparsity), with the source of
each in a comment. A peak figure is what a kernel at best reaches: the planner uses them to *rank* candidates by
an estimated step time, not to promise one. Nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bench.core.errors import UsageError, choices_error

GiB = 2**30
TFLOPS = 1e12
GB_PER_S = 1e9

# What the CUDA context (driver state, the kernels of PyTorch's libraries loaded lazily) takes on the device besides
# what the caching allocator reserves. Measured as nvidia-smi's used memory minus torch.cuda.memory_reserved(): 781
# MB before CUDA's lazy module loading (pytorch/pytorch#34323); about 300-500 MiB with lazy loading (CUDA >= 11.7,
# the default in PyTorch's CUDA builds since 2.0). The planner counts the upper figure.
CUDA_CONTEXT_BYTES = 500 * 2**20
# `plan --headroom`: the fraction of the limit a plan leaves free (fragmentation the allocator model misses, another
# library's buffers; Lightning's users ask for such a margin, Lightning#21154), how many candidates it predicts
# and for how long
DEFAULT_HEADROOM = 0.05
DEFAULT_MAX_CANDIDATES = 40
DEFAULT_MAX_SEARCH_S = 40.0  # no candidate starts after this: an answer within about a minute on any machine


def limit_with_headroom(memory_bytes: int, headroom: float = DEFAULT_HEADROOM) -> int:
    """The bytes a plan may use of `memory_bytes`, leaving the fraction `headroom` free (`plan --headroom`)."""
    return math.floor(memory_bytes * (1 - headroom))


@dataclass(frozen=True)
class GPU:
    """One GPU's published figures: memory, dense peak FLOPS per dtype (None: no such arithmetic in hardware),
    memory bandwidth, host link and link to another GPU of its node (one direction), in bytes and per second."""

    name: str
    memory_bytes: int
    fp32_flops: float  # FP32 on the CUDA cores (no tensor cores)
    tf32_flops: float | None  # TF32 tensor cores, dense
    fp16_flops: float  # FP16 tensor cores with FP32 accumulate, dense (CUDA cores at 2x FP32 without tensor cores)
    bf16_flops: float | None  # BF16 tensor cores with FP32 accumulate, dense
    bandwidth_bytes_per_s: float
    host_link_bytes_per_s: float  # PCIe, one direction
    capability: tuple[int, int]
    source: str
    # to another GPU of the node, one direction: NVLink on the SXM parts; None: over PCIe (host_link_bytes_per_s)
    nvlink_bytes_per_s: float | None = None

    @property
    def peer_link_bytes_per_s(self) -> float:
        """What one direction of its link to another GPU of the node carries: NVLink, else its PCIe link."""
        return self.nvlink_bytes_per_s or self.host_link_bytes_per_s

    def flops(self, dtype: str) -> float | None:
        """Peak dense FLOPS for arithmetic in `dtype` (float32, float16, bfloat16); None when the GPU has none.
        float32 matmuls use the CUDA cores: PyTorch's default (torch.backends.cuda.matmul.allow_tf32 is False)."""
        return {"float32": self.fp32_flops, "float16": self.fp16_flops, "bfloat16": self.bf16_flops}.get(dtype)


PCIE3_X16 = 15.75 * GB_PER_S  # PCI-SIG: 8 GT/s x16, 128b/130b encoding
PCIE4_X16 = 31.5 * GB_PER_S  # 16 GT/s x16
PCIE5_X16 = 63.0 * GB_PER_S  # 32 GT/s x16
# NVLink, one direction (the datasheets give both directions together: half of it each way). NVLink 2 (V100 SXM2):
# 6 links, 300 GB/s; NVLink 3 (A100 SXM4): 12 links, 600 GB/s; NVLink 4 (H100 and H200 SXM): 18 links, 900 GB/s
# (NVIDIA Tesla V100, A100 and H100/H200 Tensor Core GPU datasheets; nvidia.com/data-center/nvlink)
NVLINK2_EACH_WAY = 150 * GB_PER_S
NVLINK3_EACH_WAY = 300 * GB_PER_S
NVLINK4_EACH_WAY = 450 * GB_PER_S
# Between nodes, a GPU's share of the network: one 400 Gb/s NDR InfiniBand NIC a GPU, as in DGX H100/H200 (eight
# single-port ConnectX-7 VPI, up to 400 Gb/s each: NVIDIA DGX H100 User Guide, "Network Modules"; NVIDIA DGX
# BasePOD reference architecture, "Core Components"). What `plan` assumes of a collective whose group spans nodes.
NETWORK_BYTES_PER_S = 400e9 / 8
# The fixed cost of one collective, whatever its size: NCCL's own cost model starts every ring collective of its
# Simple protocol at 8.4 us before the per-step latencies (NVIDIA/nccl src/graph/tuning.cc, baseLat, Ring/Simple);
# nccl-tests' doc/PERFORMANCE.md: "time ... roughly equal to overhead + size / bw"
COLLECTIVE_LATENCY_S = 8.4e-6

GPUS: dict[str, GPU] = {gpu.name: gpu for gpu in (
    # TU117 (Turing without tensor cores): 896 CUDA cores at 1665 MHz boost; FP16 at twice the FP32 rate; no BF16.
    # NVIDIA GeForce GTX 1650 specifications (GDDR5, 128 GB/s); TechPowerUp GPU database for FP16.
    GPU("GTX 1650", 4 * GiB, 2.98 * TFLOPS, None, 5.97 * TFLOPS, None, 128 * GB_PER_S, PCIE3_X16, (7, 5),
        "NVIDIA GeForce GTX 1650 specifications; TechPowerUp GPU database"),
    # GA106: 3584 CUDA cores at 1777 MHz boost; GeForce tensor cores: FP16/BF16 with FP32 accumulate at half the
    # FP16-accumulate rate (NVIDIA Ampere GA102 whitepaper, appendix, scaled to GA106's 112 tensor cores).
    GPU("RTX 3060", 12 * GiB, 12.7 * TFLOPS, 12.7 * TFLOPS, 25.4 * TFLOPS, 25.4 * TFLOPS, 360 * GB_PER_S, PCIE4_X16,
        (8, 6), "NVIDIA GeForce RTX 3060 specifications; NVIDIA Ampere GA102 GPU architecture whitepaper"),
    # NVIDIA Ada GPU architecture whitepaper, table 2 (RTX 4090): FP32 82.6, TF32 82.6, FP16/BF16 (FP32 acc.) 165.2
    GPU("RTX 4090", 24 * GiB, 82.6 * TFLOPS, 82.6 * TFLOPS, 165.2 * TFLOPS, 165.2 * TFLOPS, 1008 * GB_PER_S,
        PCIE4_X16, (8, 9), "NVIDIA Ada GPU architecture whitepaper, table 2"),
    # NVIDIA L4 datasheet: FP32 30.3; TF32 120 and FP16/BF16 242 with sparsity (halved here); 24 GB GDDR6, 300 GB/s
    GPU("L4", 24 * GiB, 30.3 * TFLOPS, 60 * TFLOPS, 121 * TFLOPS, 121 * TFLOPS, 300 * GB_PER_S, PCIE4_X16, (8, 9),
        "NVIDIA L4 Tensor Core GPU datasheet"),
    # NVIDIA Tesla V100 datasheet (SXM2): FP32 15.7, tensor (FP16 with FP32 accumulate) 125; no TF32 or BF16;
    # 16 GB HBM2 at 900 GB/s
    GPU("V100", 16 * GiB, 15.7 * TFLOPS, None, 125 * TFLOPS, None, 900 * GB_PER_S, PCIE3_X16, (7, 0),
        "NVIDIA Tesla V100 GPU datasheet (SXM2)", NVLINK2_EACH_WAY),
    # NVIDIA Ampere GA102 whitepaper, appendix A (RTX 3090): FP32 35.6, TF32 35.6, FP16/BF16 (FP32 acc.) 71 (dense);
    # 24 GB GDDR6X at 936 GB/s
    GPU("RTX 3090", 24 * GiB, 35.6 * TFLOPS, 35.6 * TFLOPS, 71 * TFLOPS, 71 * TFLOPS, 936 * GB_PER_S, PCIE4_X16,
        (8, 6), "NVIDIA Ampere GA102 GPU architecture whitepaper, appendix A"),
    # NVIDIA A100 datasheet (SXM): FP32 19.5, TF32 156, FP16/BF16 312 (dense); 1,555 GB/s (40GB), 2,039 GB/s (80GB)
    GPU("A100 40GB", 40 * GiB, 19.5 * TFLOPS, 156 * TFLOPS, 312 * TFLOPS, 312 * TFLOPS, 1555 * GB_PER_S, PCIE4_X16,
        (8, 0), "NVIDIA A100 Tensor Core GPU datasheet (SXM4)", NVLINK3_EACH_WAY),
    GPU("A100 80GB", 80 * GiB, 19.5 * TFLOPS, 156 * TFLOPS, 312 * TFLOPS, 312 * TFLOPS, 2039 * GB_PER_S, PCIE4_X16,
        (8, 0), "NVIDIA A100 Tensor Core GPU datasheet (SXM4)", NVLINK3_EACH_WAY),
    # NVIDIA H100 datasheet (SXM5): FP32 67; TF32 989 and FP16/BF16 1,979 with sparsity (halved here); 3.35 TB/s
    GPU("H100 80GB", 80 * GiB, 67 * TFLOPS, 494.5 * TFLOPS, 989.5 * TFLOPS, 989.5 * TFLOPS, 3350 * GB_PER_S,
        PCIE5_X16, (9, 0), "NVIDIA H100 Tensor Core GPU datasheet (SXM5)", NVLINK4_EACH_WAY),
    # NVIDIA H200 datasheet (SXM): the H100's arithmetic; 141 GB HBM3e at 4.8 TB/s. Memory as the card reports it
    # (nvidia-smi: 143,771 MiB on the H200 of results/reference/gpu/h200-20261127)
    GPU("H200", 143771 * 2**20, 67 * TFLOPS, 494.5 * TFLOPS, 989.5 * TFLOPS, 989.5 * TFLOPS, 4800 * GB_PER_S,
        PCIE5_X16, (9, 0), "NVIDIA H200 Tensor Core GPU datasheet (SXM); nvidia-smi for its memory",
        NVLINK4_EACH_WAY),
)}


# The compute capabilities of NVIDIA's GPUs that PyTorch's CUDA builds run on (developer.nvidia.com/cuda-gpus and the
# CUDA programming guide's table of compute capabilities: Maxwell 5.x to Blackwell 12.x; 10.1 is Thor's number before
# CUDA 13, 11.0 after). A capability outside it names no GPU: its prediction would pick kernels for a device that
# does not exist.
COMPUTE_CAPABILITIES = ((5, 0), (5, 2), (5, 3), (6, 0), (6, 1), (6, 2), (7, 0), (7, 2), (7, 5), (8, 0), (8, 6),
                        (8, 7), (8, 9), (9, 0), (10, 0), (10, 1), (10, 3), (11, 0), (12, 0), (12, 1))


def parse_capability(value, option: str = "--capability") -> tuple[int, int] | None:
    """A compute capability as (major, minor): `"9.0"` (as the command line and nvidia-smi spell it) or `(9, 0)`;
    None for None. A UsageError naming `option` for any other spelling, or a capability no GPU has."""
    if value is None:
        return None
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(type(v) is int for v in value):
        major, minor = value
    else:
        text = str(value).strip() if isinstance(value, (str, float)) else ""
        whole, dot, fraction = text.partition(".")
        if not (dot and whole.isdigit() and fraction.isdigit() and len(fraction) == 1):
            raise UsageError(f"{option}: bad compute capability {value!r}; give MAJOR.MINOR as nvidia-smi "
                             "--query-gpu=compute_cap prints it, e.g. 8.6 or 9.0")
        major, minor = int(whole), int(fraction)
    if (major, minor) not in COMPUTE_CAPABILITIES:
        raise UsageError(f"{option}: no GPU has compute capability {major}.{minor}; valid choices: "
                         + ", ".join(f"{a}.{b}" for a, b in COMPUTE_CAPABILITIES))
    return major, minor


def capability_for(value, device: str, gpu: GPU | None = None, option: str = "--capability") -> tuple[int, int] | None:
    """The compute capability a prediction on `device` picks its kernels by: `value` (`parse_capability`), else the
    `gpu`'s, else None (this machine's GPU, or a default one). A UsageError where `value` is given for the CPU, which
    has none: the option would be taken and change nothing."""
    parsed = parse_capability(value, option)
    if parsed is not None and device != "cuda":
        raise UsageError(f"{option} {value}: a compute capability is a CUDA device's, and this prediction is for "
                         f"device {device!r}; drop it, or predict for cuda")
    return parsed or (gpu.capability if gpu is not None else None)


def _key(name: str) -> str:
    return "".join(name.lower().split()).replace("-", "")


def find_gpu(name: str) -> GPU:
    """The GPU named `name` (case, spaces and dashes ignored: `rtx4090`, `a100-80gb`), or the one it begins (`H100`);
    a UsageError naming the choices otherwise."""
    exact = [gpu for gpu in GPUS.values() if _key(gpu.name) == _key(name)]
    prefixed = [gpu for gpu in GPUS.values() if _key(gpu.name).startswith(_key(name))] if _key(name) else []
    if exact or len(prefixed) == 1:  # `H100` is the one H100; `A100` is two
        return (exact or prefixed)[0]
    raise choices_error("GPU", name, list(GPUS))


def format_gpus() -> str:
    """`plan --list-gpus`: the table, one GPU a line."""
    header = (f"{'GPU':<10} {'memory GiB':>10} {'FP32 TFLOPS':>11} {'FP16 TFLOPS':>11} {'BF16 TFLOPS':>11} "
              f"{'memory GB/s':>11} {'host GB/s':>9} {'GPU link GB/s':>13}  source")
    lines = [header, "-" * len(header)]
    for gpu in GPUS.values():
        bf16 = f"{gpu.bf16_flops / TFLOPS:.1f}" if gpu.bf16_flops else "-"
        lines.append(f"{gpu.name:<10} {gpu.memory_bytes / GiB:>10.0f} {gpu.fp32_flops / TFLOPS:>11.1f} "
                     f"{gpu.fp16_flops / TFLOPS:>11.1f} {bf16:>11} {gpu.bandwidth_bytes_per_s / GB_PER_S:>11,.0f} "
                     f"{gpu.host_link_bytes_per_s / GB_PER_S:>9.1f} "
                     f"{gpu.peer_link_bytes_per_s / GB_PER_S:>8.1f} {'NVL' if gpu.nvlink_bytes_per_s else 'PCIe':<4}"
                     f"  {gpu.source}")
    lines.append(f"dense peaks (no sparsity); links one direction (GPU link: to another GPU of the node; between "
                 f"nodes {NETWORK_BYTES_PER_S / GB_PER_S:.0f} GB/s a GPU); each process also holds a CUDA context, "
                 f"counted as {CUDA_CONTEXT_BYTES / 2**20:.0f} MiB")
    return "\n".join(lines)
