"""The process's own resident memory over one case: its peak, the process at rest before it, and the harness's share.

The counted peak (`peak_mem_bytes`) is the workload's step; the process holds more: the interpreter and the
libraries (torch, transformers), and what the harness keeps (the verification's copies, caches, per-case state).
A user with a 16 GB machine needs to know the whole, so every row records it:

- `process_peak_rss_bytes`: the process's peak resident set over the case (verification, timing and memory passes).
  On Linux the kernel keeps that peak (VmHWM in /proc/self/status) and resets it on `echo 5 > /proc/self/clear_refs`;
  the kernel raises VmHWM before any unmap or madvise lowers the resident set, so the figure is exact, not
  sampled: a sampler misses a peak shorter than its period. Where the reset is not allowed (another OS, a locked
  /proc), `ru_maxrss` is the process's peak since it started: exact for a case run in its own worker (`--isolate`),
  an upper bound in-process; `process_rss_method` says which.
- `process_rest_rss_bytes`: the resident set just before the case, after a garbage collection and `malloc_trim`:
  the interpreter and the libraries at rest (and, in an in-process sweep, what earlier cases left behind: a leak
  shows as this figure growing from row to row).
- `harness_rss_bytes`: peak minus counted peak minus rest: what the harness itself held at the peak.

Before a case the process pins glibc's mmap threshold (`pin_mmap_threshold`): glibc otherwise raises it to the size
of each mmapped block freed (up to 32 MiB), after which a step's tensors of up to that size are carved from the heap,
where a freed one is reused only by what fits in its hole; the captcha model's training step at batch 100 held
1.42x its 737 MiB of live tensors above the process at rest that way, pinned 1.02x (docs/measuring.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import resource
import sys
from dataclasses import dataclass
from typing import Any

from bench.core.job_environment import MMAP_THRESHOLD_OFF, MMAP_THRESHOLD_VARIABLE, size_variable

RESIDENT_COLUMNS = ("process_peak_rss_bytes", "process_rest_rss_bytes", "harness_rss_bytes", "process_rss_method")
# The goal the harness is held to: resident <= GOAL_FACTOR x the counted peak + the process at rest.
GOAL_FACTOR = 1.3

# Tensors of at least this many bytes are mmapped by glibc and unmapped when freed (see pin_mmap_threshold).
MMAP_THRESHOLD_BYTES = 1 << 20
THRESHOLD_VARIABLE = MMAP_THRESHOLD_VARIABLE
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number, from glibc's malloc.h

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _status_kib(field: str) -> int | None:
    try:
        with open(_STATUS) as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss_bytes() -> int | None:
    """The process's resident set now (VmRSS), or None where /proc does not say."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def _maxrss_bytes() -> int:
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, KiB on Linux


def reset_peak() -> bool:
    """Resets the kernel's peak resident set of this process (VmHWM) to the current one; False where not allowed."""
    try:
        with open(_CLEAR_REFS, "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """The process's peak resident set: VmHWM since the last reset where /proc has it, else ru_maxrss."""
    kib = _status_kib("VmHWM")
    return kib * 1024 if kib is not None else _maxrss_bytes()


_libc: Any = None


def _glibc() -> Any:
    """Glibc through ctypes, or False where the C library is another (musl and macOS have no malloc_trim)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.malloc_trim  # noqa: B018 - musl and macOS have none
            _libc.mallopt  # noqa: B018
        except (OSError, AttributeError):
            _libc = False
    return _libc


def trim_heap() -> bool:
    """Returns the C heap's free pages to the system (glibc's `malloc_trim(0)`): freed tensors of a finished case
    otherwise stay resident in malloc's arenas. False where the C library has no such call."""
    libc = _glibc()
    return bool(libc) and bool(libc.malloc_trim(0))


def mmap_threshold_setting() -> int | None:
    """The mmap threshold this process pins, in bytes: MMAP_THRESHOLD_BYTES, or `MEMBENCH_MMAP_THRESHOLD` (bytes;
    `off` leaves glibc's own, dynamic one); None also where the user set glibc's `MALLOC_MMAP_THRESHOLD_`, which
    glibc has read already and which pins it as well."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return None
    return size_variable(THRESHOLD_VARIABLE, MMAP_THRESHOLD_BYTES, MMAP_THRESHOLD_OFF)  # -5 is refused, not `off`


def pin_mmap_threshold() -> bool:
    """Makes glibc mmap every block of at least `mmap_threshold_setting()` bytes, and keep doing so: the harness's
    share of resident memory is then the harness's, not the heap's holes.

    glibc starts at 128 KiB, and each time a mmapped block is freed raises the threshold to that block's size (up to
    32 MiB) to save the next such allocation its system call; a step's tensors of up to that size then come from
    the heap, and a freed one leaves a hole that only a block that fits reuses, so that a step whose tensors change
    size from layer to layer (a CNN's feature maps, a transformer's logits beside its hidden states) grows the heap
    to well above its live bytes. `mallopt(M_MMAP_THRESHOLD)` sets the threshold and turns that adjustment off.
    The cost: a mmapped tensor's pages are faulted in anew each time (the kernel zeroes them), where a heap hole's
    are reused; docs/measuring.md gives the figures. False where nothing was set (not glibc, or `off`).

    The earlier the better: a request above the threshold is still carved from a free region of the heap where one
    is large enough, so a heap that grew before the pin (the CLI's pre-run checks, a first model built) keeps
    fragmenting; the CLI pins it as it starts, each case again (the Python API, a worker)."""
    global _pinned_threshold
    threshold = mmap_threshold_setting()
    libc = _glibc()
    if threshold is None or not libc:
        return False
    threshold = min(threshold, 2**31 - 1)
    if not libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(threshold)):
        return False
    _pinned_threshold = threshold
    return True


_pinned_threshold: int | None = None


def pinned_mmap_threshold() -> int | None:
    """The mmap threshold `pin_mmap_threshold` set in this process, in bytes; None where it set none (glibc's own,
    dynamic threshold: `MEMBENCH_MMAP_THRESHOLD=off`, a user's `MALLOC_MMAP_THRESHOLD_`, not glibc, or not pinned).
    Recorded in every results row (`host_mmap_threshold_bytes`): it moves CPU step times (docs/measuring.md)."""
    return _pinned_threshold


def release_host_memory() -> None:
    """Frees what nothing refers to any more (cycles included) and gives the heap's free pages back to the system."""
    gc.collect()
    trim_heap()


_warmed: set[str] = set()


def warm_libraries(device: str = "cpu") -> None:
    """One tiny training step on `device`, once per process: the libraries' lazy state (oneDNN's and the autograd
    engine's first use: about 80 MiB on a CPU, results/reference/library_lazy_state/) is part of the process at
    rest, not of the first case's harness."""
    if device in _warmed or device not in ("cpu", "cuda"):
        return
    _warmed.add(device)
    import torch

    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(device)
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.ones(2, 8, device=device)).sum().backward()
        optimizer.step()


@dataclass
class ResidentMeter:
    """The resident memory of one case: `start()` before it, `columns(counted_peak)` after it."""

    rest_bytes: int | None = None
    method: str = "ru_maxrss"

    def start(self) -> "ResidentMeter":
        pin_mmap_threshold()
        warm_libraries("cpu")
        release_host_memory()
        self.rest_bytes = current_rss_bytes()
        if self.rest_bytes is None:  # no /proc: the peak so far is the best figure of the process at rest
            self.rest_bytes = _maxrss_bytes()
        self.method = "vmhwm_reset" if reset_peak() else "ru_maxrss"
        return self

    def columns(self, counted_peak: int | None) -> dict[str, Any]:
        """The row's RESIDENT_COLUMNS; `harness_rss_bytes` empty where nothing was counted (a failed case)."""
        peak = peak_rss_bytes()
        harness = None if counted_peak is None or self.rest_bytes is None else peak - int(counted_peak) - self.rest_bytes
        return {"process_peak_rss_bytes": peak, "process_rest_rss_bytes": self.rest_bytes,
                "harness_rss_bytes": harness, "process_rss_method": self.method}


def within_goal(peak_rss: int, counted_peak: int, rest: int, factor: float = GOAL_FACTOR) -> bool:
    """Whether the resident peak is within the goal: at most `factor` x the counted peak plus the process at rest."""
    return peak_rss <= factor * counted_peak + rest


def goal_ratio(peak_rss: int, counted_peak: int, rest: int) -> float:
    """(resident peak - rest) / counted peak: the goal is at most GOAL_FACTOR."""
    return (peak_rss - rest) / max(counted_peak, 1)


def available_bytes() -> int | None:
    """The memory the machine can give a new process without swapping (MemAvailable), or None where not known."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
