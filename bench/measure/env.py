"""The environment a result was measured in, recorded in every row."""

from __future__ import annotations

import functools
import platform
import socket
import subprocess
from pathlib import Path

import torch

from bench.core.errors import UsageError
from bench.measure import cpu_16bit, resident

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def resolve_device(device: str) -> str:
    """`auto` -> cuda when available else cpu; `cuda` without a GPU is a UsageError."""
    if device not in DEVICE_CHOICES:
        raise UsageError(f"unknown device {device!r}; valid choices: {', '.join(DEVICE_CHOICES)}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("device 'cuda' requested but torch.cuda.is_available() is False "
                         f"(torch {torch.__version__}); valid choices here: auto, cpu")
    return device


@functools.lru_cache(maxsize=None)
def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, else platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)
def git_commit() -> str:
    """The commit of the membench checkout, with `-dirty` when it has uncommitted changes; `unknown` outside git."""
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_capability() -> str:
    """The instruction set of PyTorch's CPU kernels (`torch.backends.cpu.get_cpu_capability()`: AVX2, AVX512, ...),
    and oneDNN's cap where one is set (`AVX512; oneDNN AVX2`)."""
    cap = cpu_16bit.onednn_isa_cap()
    return torch.backends.cpu.get_cpu_capability() + (f"; oneDNN {cap[1]}" if cap else "")


def device_name(device: str) -> str:
    """The GPU's name on CUDA, the CPU model on the CPU."""
    return torch.cuda.get_device_name() if device == "cuda" else cpu_name()


def environment(device: str) -> dict:
    """torch, CUDA and cuDNN versions, device and host name, CPU threads and native 16-bit arithmetic, git commit,
    Python and OS, and the C heap's mmap threshold the process pinned (bench.measure.resident)."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    support = cpu_16bit.cpu_16bit_support()
    return {
        "device_name": device_name(device),
        "host_name": socket.gethostname(),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda or "none",
        "cudnn_version": str(cudnn) if cudnn else "none",
        "cpu_threads": torch.get_num_threads(),
        "cpu_capability": cpu_capability(),
        "cpu_bf16_native": support["bfloat16"],
        "cpu_fp16_native": support["float16"],
        "git_commit": git_commit(),
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "host_mmap_threshold_bytes": resident.pinned_mmap_threshold(),
    }
