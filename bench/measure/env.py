"""The environment a result was measured in, recorded in every row."""

from __future__ import annotations

import functools
import os
import platform
import socket
import subprocess
from pathlib import Path

import torch

from bench.core.errors import UsageError

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


# /proc/cpuinfo flags that mean native 16-bit arithmetic: x86 (AVX-512 and AMX) and aarch64 (FEAT_BF16; FEAT_FP16,
# shown as fphp for scalars and asimdhp for vectors). Without them oneDNN and ATen convert every 16-bit operand to
# float32 and back: bfloat16 autocast then runs 15-23x slower than float32 (AMD EPYC,
# results/reference/captcha_no_bf16).
NATIVE_16BIT_FLAGS = {
    "bfloat16": ("avx512_bf16", "amx_bf16", "bf16"),
    "float16": ("avx512_fp16", "amx_fp16", "fphp", "asimdhp"),
}


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str] | None:
    """The first CPU's feature flags from /proc/cpuinfo (`flags` on x86, `Features` on aarch64); None elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return frozenset(value.split())
    except OSError:
        pass
    return None


def _torch_says_native(dtype: str) -> bool:
    """torch's own CPU probe (cpuinfo), for systems without /proc/cpuinfo; x86 only, False where it cannot tell."""
    import torch.cpu

    probes = {"bfloat16": ("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
              "float16": ("_is_amx_fp16_supported",)}[dtype]
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


# MEMBENCH_CPU_16BIT: how membench treats 16-bit autocast on this machine's CPU. `auto` (or unset) asks the CPU;
# `emulated` treats every 16-bit type as emulated (the fast emulated path of bench.run.runner, and its tests, on any
# CPU), `native` as native (full real steps, whatever the CPU). Rows record what membench took.
CPU_16BIT_VARIABLE = "MEMBENCH_CPU_16BIT"
CPU_16BIT_CHOICES = ("auto", "emulated", "native")


def cpu_16bit_setting() -> str:
    """MEMBENCH_CPU_16BIT's value (`auto` when unset or empty); another value is a UsageError naming the choices."""
    value = os.environ.get(CPU_16BIT_VARIABLE, "").strip().lower() or "auto"
    if value not in CPU_16BIT_CHOICES:
        raise UsageError(f"{CPU_16BIT_VARIABLE}={os.environ[CPU_16BIT_VARIABLE]!r}: unknown setting; valid choices: "
                         f"{', '.join(CPU_16BIT_CHOICES)}")
    return value


# oneDNN (torch's CPU matmuls and convolutions) can be kept below the CPU's instruction set by ONEDNN_MAX_CPU_ISA
# (DNNL_MAX_CPU_ISA before oneDNN 2): capped at AVX2 on this project's AMD EPYC with AVX-512 bfloat16, a bfloat16
# matmul runs 32x and a convolution 37x slower than in float32, as on a CPU with AVX2 only. Each cap's bits are
# oneDNN's `dnnl_cpu_isa_t`; a type is native under a cap that holds one of its instruction sets' bits.
ONEDNN_ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
ONEDNN_ISA_BITS = {
    "SSE41": 0x1, "AVX": 0x3, "AVX2": 0x7, "AVX2_VNNI": 0xF, "AVX2_VNNI_2": 0x1F, "AVX512_CORE": 0x27,
    "AVX512_CORE_VNNI": 0x67, "AVX512_CORE_BF16": 0xE7, "AVX10_1_512": 0x1EF, "AVX512_CORE_FP16": 0x1EF,
    "AVX10_1_512_AMX": 0xFEF, "AVX512_CORE_AMX": 0xFEF, "AVX10_1_512_AMX_FP16": 0x1FEF,
    "AVX512_CORE_AMX_FP16": 0x1FEF,
}
ONEDNN_NATIVE_16BIT_BITS = {"bfloat16": (0xE7, 0x1F), "float16": (0x1EF, 0x1F)}  # AVX-512 BF16 / FP16, AVX2_VNNI_2


def onednn_isa_cap() -> tuple[str, str] | None:
    """(variable, value) of the oneDNN ISA cap set in this process's environment; None without one (or `ALL`, an
    unknown value: oneDNN ignores those)."""
    for variable in ONEDNN_ISA_VARIABLES:
        value = os.environ.get(variable, "").strip().upper()
        if value in ONEDNN_ISA_BITS:
            return variable, value
    return None


def capped_16bit(support: dict[str, bool], cap: str | None) -> dict[str, bool]:
    """`support` with the types that oneDNN capped at `cap` (an ONEDNN_ISA_BITS key) runs emulated marked so."""
    if cap is None:
        return support
    bits = ONEDNN_ISA_BITS[cap]
    return {dtype: native and any(bits & needed == needed for needed in ONEDNN_NATIVE_16BIT_BITS[dtype])
            for dtype, native in support.items()}


def onednn_cap_emulating(dtype: str) -> tuple[str, str] | None:
    """(variable, value) of the oneDNN cap that makes `dtype` emulated on this machine's CPU, which has native
    instructions for it; None where there is no such cap (or the CPU itself lacks them)."""
    cap = onednn_isa_cap()
    flags = cpu_flags()
    native = _torch_says_native(dtype) if flags is None else any(f in flags for f in NATIVE_16BIT_FLAGS[dtype])
    return cap if cap and native and not capped_16bit({dtype: True}, cap[1])[dtype] else None


def cpu_16bit_support(flags: frozenset[str] | set[str] | None = None) -> dict[str, bool]:
    """{"bfloat16": bool, "float16": bool}: whether the CPU has native arithmetic for each 16-bit float type.

    `flags` (a set of /proc/cpuinfo flags) replaces this machine's, so that the answer for any CPU can be tested;
    for this machine's CPU, MEMBENCH_CPU_16BIT=emulated or native (`cpu_16bit_setting`) overrides the answer, and a
    oneDNN ISA cap below a type's instructions (`onednn_isa_cap`) makes it emulated."""
    if flags is None and cpu_16bit_setting() != "auto":
        return dict.fromkeys(NATIVE_16BIT_FLAGS, cpu_16bit_setting() == "native")
    this_machine = flags is None
    flags = cpu_flags() if flags is None else frozenset(flags)
    if flags is None:
        support = {dtype: _torch_says_native(dtype) for dtype in NATIVE_16BIT_FLAGS}
    else:
        support = {dtype: any(flag in flags for flag in names) for dtype, names in NATIVE_16BIT_FLAGS.items()}
    cap = onednn_isa_cap() if this_machine else None
    return capped_16bit(support, cap and cap[1])


def emulated_on_cpu(dtype: str | None, device: str, support: dict[str, bool] | None = None) -> bool:
    """Whether arithmetic in `dtype` (a 16-bit float type, or None) on `device` is emulated in float32 by the CPU."""
    if device != "cpu" or dtype not in NATIVE_16BIT_FLAGS:
        return False
    return not (support or cpu_16bit_support())[dtype]


def cpu_capability() -> str:
    """The instruction set of PyTorch's CPU kernels (`torch.backends.cpu.get_cpu_capability()`: AVX2, AVX512, ...),
    and oneDNN's cap where one is set (`AVX512; oneDNN AVX2`)."""
    cap = onednn_isa_cap()
    return torch.backends.cpu.get_cpu_capability() + (f"; oneDNN {cap[1]}" if cap else "")


def device_name(device: str) -> str:
    """The GPU's name on CUDA, the CPU model on the CPU."""
    return torch.cuda.get_device_name() if device == "cuda" else cpu_name()


def environment(device: str) -> dict:
    """torch, CUDA and cuDNN versions, device and host name, CPU threads and native 16-bit arithmetic, git commit,
    Python and OS."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    support = cpu_16bit_support()
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
    }
