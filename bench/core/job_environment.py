"""The environment a command runs in, checked and cleaned before it does anything: a torchrun or SLURM shell's
rendezvous variables (which membench's own rank processes and workers must not inherit), and membench's own
variables ($MEMBENCH_PLUGINS, $MEMBENCH_CPU_16BIT, the sizes, an internal one set by hand): a bad value refused in
one line before the first case, by every command that computes, and read by one reader (`variable`, `size_variable`)
wherever it is used.

Nothing here imports torch: `report` and a usage error stay quick.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from bench.core.errors import UsageError
from bench.core.units import parse_positive_size

# torch.distributed's env:// rendezvous (what torchrun sets, and SLURM scripts export for it). Inherited, they make
# an isolated worker think it is one rank of a job that does not exist: it waits for peers until the case timeout.
# membench launches its own ranks (bench.run.ranks) with values of its own.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
LAUNCHER_PREFIXES = ("TORCHELASTIC_",)
# MEMBENCH_PLUGINS: a comma list of modules every worker process imports first (e.g. to register strategies);
# `plugin_modules` reads it
PLUGINS_VARIABLE = "MEMBENCH_PLUGINS"
# MEMBENCH_CPU_16BIT: how membench treats 16-bit autocast on this machine's CPU (bench.measure.cpu_16bit decides with
# it). `auto` (or unset) asks the CPU; `emulated` treats every 16-bit type as emulated (the fast emulated path of
# bench.run.runner, and its tests, on any CPU), `native` as native (full real steps, whatever the CPU). Rows record
# what membench took.
CPU_16BIT_VARIABLE = "MEMBENCH_CPU_16BIT"
CPU_16BIT_CHOICES = ("auto", "emulated", "native")
# MEMBENCH_MMAP_THRESHOLD: the C heap's mmap threshold membench pins (bench.measure.resident): a size, or `off`
MMAP_THRESHOLD_VARIABLE = "MEMBENCH_MMAP_THRESHOLD"
MMAP_THRESHOLD_OFF = ("off", "none", "default", "0")
# MEMBENCH_ANCHOR_WORKER_BYTES: the address space of each `anchors` fake-CUDA worker (bench.analysis.anchors)
ANCHOR_WORKER_BYTES_VARIABLE = "MEMBENCH_ANCHOR_WORKER_BYTES"
# MEMBENCH_PROOF_BESIDE: "0" keeps layer replay's proof traces in the predicting process, never in a worker beside
# it (bench.analysis.proof_beside)
PROOF_BESIDE_VARIABLE = "MEMBENCH_PROOF_BESIDE"
# MEMBENCH_FULL_TRACE: "1" makes every prediction trace all its layers and run every call (no layer replay:
# bench.analysis.layer_replay; no call replay: bench.measure.call_replay)
FULL_TRACE_VARIABLE = "MEMBENCH_FULL_TRACE"
# MEMBENCH_CACHE: the folder of generated data sets (workloads.framework.captcha_data)
CACHE_VARIABLE = "MEMBENCH_CACHE"
# MEMBENCH_CUDA_ENV: the fake-CUDA environment `predict --device cuda` uses (bench.measure.fake_cuda), where
# `python -m bench cuda-env --path` built it somewhere else than the default
CUDA_ENV_VARIABLE = "MEMBENCH_CUDA_ENV"
# Variables membench sets in the processes it starts, never a user's setting: set by hand, a torch without CUDA
# would be made to act as a fake-CUDA worker on its first import
INTERNAL_VARIABLES = ("MEMBENCH_FAKE_CUDA_WORKER",)


def variable(name: str) -> str | None:
    """The value of environment variable `name`, stripped; None where it is unset or blank (one meaning for both:
    `MEMBENCH_CACHE=` is no folder, not the working directory)."""
    value = os.environ.get(name, "").strip()
    return value or None


def full_trace_forced() -> bool:
    """Whether MEMBENCH_FULL_TRACE asks every prediction to trace all its layers and run every call."""
    return (variable(FULL_TRACE_VARIABLE) or "0") != "0"


def size_variable(name: str, default: int | None, off: tuple[str, ...] = ()) -> int | None:
    """A size in bytes from variable `name` (`12GiB`, `1e9`, `4096`): `default` where unset, None for a word of
    `off`; a negative, zero or meaningless value is a UsageError naming the variable (never taken as `off`)."""
    value = variable(name)
    if value is None:
        return default
    if value.lower() in off:
        return None
    try:
        return parse_positive_size(value)
    except ValueError:
        words = " or ".join(["a positive size in bytes (e.g. 4096, 1MiB, 12GiB)", *(f"`{w}`" for w in off[:1])])
        raise UsageError(f"{name}={os.environ[name]!r}: expected {words}; fix or unset {name}") from None


def check_sizes() -> None:
    """The size variables parse (`size_variable`), before anything is run with them."""
    size_variable(MMAP_THRESHOLD_VARIABLE, None, MMAP_THRESHOLD_OFF)
    size_variable(ANCHOR_WORKER_BYTES_VARIABLE, None)


def check_internal_variables() -> None:
    """No variable of INTERNAL_VARIABLES is set where it cannot work; a UsageError naming it otherwise. In the
    fake-CUDA environment (a CUDA build of torch over stub libraries) MEMBENCH_FAKE_CUDA_WORKER=1 is how
    `bench.measure.fake_cuda.worker_environment` runs a command whose isolated cases run on fake CUDA; with a torch
    built without CUDA it would make the first import fail."""
    for name in INTERNAL_VARIABLES:
        if name in os.environ and not _cuda_build():
            raise UsageError(f"{name} is set ({name}={os.environ[name]!r}): it is membench's own, set in the worker "
                             f"processes it starts, not a setting; unset {name}")


def _cuda_build() -> bool:
    """Whether this torch is a CUDA build (imported only when an internal variable is set)."""
    import torch

    return torch.version.cuda is not None


def launcher_variables(environ=None) -> list[str]:
    """The launcher's variables set in `environ` (default this process's), in a stable order."""
    environ = os.environ if environ is None else environ
    return [name for name in environ if name in LAUNCHER_VARIABLES or name.startswith(LAUNCHER_PREFIXES)]


def without_launcher_variables(environ) -> dict[str, str]:
    """`environ` without a launcher's variables: the environment of a process membench starts."""
    found = set(launcher_variables(environ))
    return {name: value for name, value in environ.items() if name not in found}


def clear_launcher_variables() -> None:
    """Removes a launcher's variables from this process (so that no process it starts inherits them), saying so
    once on stderr."""
    found = launcher_variables()
    if not found:
        return
    shown = ", ".join(f"{name}={os.environ[name]}" for name in sorted(found)[:6])
    more = f" and {len(found) - 6} more" if len(found) > 6 else ""
    print(f"note: ignoring {shown}{more} from this shell (a torchrun or SLURM job's): membench starts its own "
          "processes, and ranks with --ranks N", file=sys.stderr, flush=True)
    for name in found:
        del os.environ[name]


def plugin_modules(environ=None) -> list[str]:
    """The modules $MEMBENCH_PLUGINS names in `environ` (default this process's), in its order."""
    environ = os.environ if environ is None else environ
    return [module.strip() for module in environ.get(PLUGINS_VARIABLE, "").split(",") if module.strip()]


def check_plugins() -> None:
    """Each module $MEMBENCH_PLUGINS names can be found (not imported: a worker imports it), or a UsageError."""
    for module in plugin_modules():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise UsageError(f"{PLUGINS_VARIABLE} names the module {module!r}, which cannot be imported here (not on "
                             f"sys.path); fix or unset {PLUGINS_VARIABLE}")


def cpu_16bit_setting() -> str:
    """MEMBENCH_CPU_16BIT's value (`auto` when unset or empty); another value is a UsageError naming the choices."""
    value = os.environ.get(CPU_16BIT_VARIABLE, "").strip().lower() or "auto"
    if value not in CPU_16BIT_CHOICES:
        raise UsageError(f"{CPU_16BIT_VARIABLE}={os.environ[CPU_16BIT_VARIABLE]!r}: unknown setting; valid choices: "
                         f"{', '.join(CPU_16BIT_CHOICES)}")
    return value


def check_cpu_16bit() -> None:
    """$MEMBENCH_CPU_16BIT is unset or one of its choices, or a UsageError (`cpu_16bit_setting`)."""
    cpu_16bit_setting()


def check_job_environment(command: str) -> None:
    """Everything above, before `command` does anything; `report` draws from files and `cuda-env` builds an
    environment: they need none of it."""
    if command in ("report", "cuda-env"):
        return
    check_internal_variables()
    check_cpu_16bit()
    check_sizes()
    check_plugins()
    clear_launcher_variables()
