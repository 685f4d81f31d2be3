"""Checks made before the first case runs: the output location, absurd values, every case's strategy, whether the
largest batch fits in this machine's memory, one run per file.

A sweep can take hours; a mistake found after the first case has been measured costs that case's minutes, and
a mistake that aborts the sweep halfway costs every case after it. So everything that can be known without
measuring is checked here, up front, and reported as a UsageError that names the option and the limit.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from bench.core.errors import Unsupported, UnsupportedValue, UsageError, choices_error
from bench.core.units import format_size
from bench.measure.resident import GOAL_FACTOR, available_bytes, current_rss_bytes

# The steps of a case unless the suite or the command line says otherwise.
DEFAULT_WARMUP_STEPS = 3
DEFAULT_MEASURED_STEPS = 10  # what --quick and a suite's `steps` replace; not a default of `run` any more
# Adaptive timing (bench.measure.timing.TimingPolicy) unless a step count is given: at least DEFAULT_MIN_STEPS timed
# steps, then until the median's 95% interval is within DEFAULT_TARGET_CI (of the median) or DEFAULT_MAX_TIME_PER_CASE_S
# seconds of timed steps have run. 5%: the smallest time effect the strategies are compared on (bench.measure.stats).
DEFAULT_MIN_STEPS = 5
DEFAULT_MAX_TIME_PER_CASE_S = 30.0
DEFAULT_TARGET_CI = 0.05
# More measured (or warm-up) steps than this per case is a typo, not a benchmark: at a tenth of a second a step,
# the limit alone is 17 minutes of one case.
MAX_STEPS = 10_000
# A run holds more than one step's live tensors (the heap's free pages between tensors, what the harness keeps):
# at most GOAL_FACTOR (1.3) x the step's peak, plus the process at rest (bench.measure.resident; measured by
# benchmarks/resident_memory.py on every built-in workload).
RUN_MEMORY_FACTOR = GOAL_FACTOR
MEMORY_PROBE_BATCH = 64


def check_choice(kind: str, value: str, choices: Sequence[str], option: str | None = None) -> str:
    """`value` if it is one of `choices`; else a UsageError naming the option (default `--<kind>`)."""
    if value not in choices:
        raise UsageError(f"{option or '--' + kind}: {choices_error(kind, value, choices)}")
    return value


def no_cuda_message(torch_version: str, cuda_build: str | None, python: str = "python") -> str:
    """The one line for `--device cuda` where torch sees no CUDA device: with a CPU-only build of torch, how to
    install PyPI's CUDA build of the same version (the `===` exact match: `==` would keep the local `+cpu` one)."""
    if cuda_build:
        return (f"--device cuda: torch {torch_version} is a CUDA {cuda_build} build but sees no CUDA device (no GPU, "
                "or no driver: check nvidia-smi); valid choices here: auto, cpu")
    release = torch_version.split("+")[0]
    return (f"--device cuda: there is no CUDA device, and torch {torch_version} is a CPU-only build; on a machine "
            f"with an NVIDIA GPU install a CUDA build with `{python} -m pip install 'torch==={release}'` (PyPI's "
            "Linux x86_64 wheel; or --index-url https://download.pytorch.org/whl/<cuda version>)")


def parse_batch_sizes(text: str, option: str = "--batch-size") -> list[int]:
    """`100` or `25,50,100` -> positive integers; anything else is a UsageError naming the bad part."""
    sizes = []
    for part in str(text).split(","):
        try:
            size = int(part)
        except ValueError:
            size = 0
        if size <= 0:
            raise UsageError(f"{option}: bad batch size {part.strip()!r}; a batch size must be a positive "
                             "integer (e.g. 100 or 25,50,100)")
        sizes.append(size)
    return sizes


def parse_batch_size(text, option: str = "--batch-size") -> int:
    """The one batch size a command (or an argument of the Python API) takes: `parse_batch_sizes` of exactly one
    size; a UsageError naming `option` for a list or a bad size (0 is no batch, never "the default")."""
    sizes = parse_batch_sizes(text, option)
    if len(sizes) != 1:
        raise UsageError(f"{option}: bad batch size {text!r}; this command takes one batch size")
    return sizes[0]


def check_output_dir(path: Path | str, option: str) -> Path:
    """`path` as a folder we can write into (created if missing), absolute (a workload that changes the working
    directory does not move it); a UsageError naming `option` otherwise.

    Checked by creating and removing a file in it, since permissions alone do not tell: a read-only file system,
    a folder where a file is, or a path under a file fail only when written to."""
    path = Path(path)
    try:
        if path.exists() and not path.is_dir():
            raise UsageError(f"{option} {str(path)!r} is a file, not a folder; give a folder (it is created if "
                             "missing)")
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".membench-write-check.")
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        reason = error.strerror or str(error)
        if error.errno == errno.ENOTDIR:
            reason = "a part of the path is a file"
        raise UsageError(f"{option} {str(path)!r} is not a writable folder: {reason}") from None
    return Path(os.path.abspath(path))


def check_output_file(path: Path | str, option: str) -> Path:
    """A file we will rewrite (atomically, so its folder must be writable too), absolute as `check_output_dir`'s
    folder; a UsageError naming `option`."""
    path = Path(path)
    check_output_dir(path.parent, f"{option}'s folder")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{option} {str(path)!r} is not writable")
    return Path(os.path.abspath(path))


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def machine_memory_bytes() -> int | None:
    """Physical memory of this machine, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_threads(threads: int | None) -> None:
    """`--threads` above the cores this process may use would time thread contention, not the strategy."""
    cores = available_cores()
    if threads is not None and threads > cores:
        raise UsageError(f"--threads {threads} is more than the {cores} CPU cores available here; "
                         f"give at most {cores}")


# More repeats of a case than this is a typo: each repeat is a full timing and memory pass (a fresh process under
# --isolate); pyperf's default is 20 processes
MAX_REPEATS = 100


def check_repeats(repeats: int) -> None:
    """`--repeats` up to MAX_REPEATS; a UsageError naming the limit otherwise."""
    if repeats > MAX_REPEATS:
        raise UsageError(f"--repeats {repeats:,} is more than the limit of {MAX_REPEATS} per case; 3 to 10 repeats "
                         "give a confidence interval of the median")


# `--ranks` where no real process runs (predict's and plan's fake process group): more than the largest training
# clusters is a typo
MAX_PREDICTED_RANKS = 1 << 17


def check_ranks(ranks: int, device: str | None) -> None:
    """`--ranks` that this machine can start as processes (`device` cpu or cuda: one process per core, or per GPU,
    each with its own copy of the model), or at most MAX_PREDICTED_RANKS where none is started (`device` None)."""
    if ranks <= 1:
        return
    if device is None:
        if ranks > MAX_PREDICTED_RANKS:
            raise UsageError(f"--ranks {ranks:,} is more than {MAX_PREDICTED_RANKS:,}, more ranks than any training "
                             "cluster has; give at most that")
        return
    if device == "cuda":
        import torch

        have, what = torch.cuda.device_count(), "GPUs (one rank per GPU)"
    else:
        have, what = available_cores(), "CPU cores available here (one rank process per core)"
    if ranks > have:
        raise UsageError(f"--ranks {ranks:,} is more than the {have} {what}; give at most {have} (predict and plan "
                         "--ranks N answer for more without starting them)")


def check_ranks_shard(ranks: int, strategies: Iterable, option: str = "--ranks") -> None:
    """`--ranks N` (N > 1) where at least one of `strategies` (specs, or parsed strategies) shards the step over the
    ranks; a UsageError otherwise. Without one, every case would be the step of the N ranks' whole batch on one
    device: a figure of another question, given as the answer to this one."""
    if ranks <= 1:
        return
    from strategies import STRATEGIES, parse_strategy

    parsed = [s if hasattr(s, "distributed") else parse_strategy(s) for s in strategies]
    if any(strategy.distributed for strategy in parsed):
        return
    sharded = [name for name in STRATEGIES.names() if STRATEGIES.get(name).distributed]
    given = ", ".join(dict.fromkeys(strategy.spec() for strategy in parsed)) or "none"
    raise UsageError(f"{option} {ranks}: none of the strategies ({given}) shards the step over ranks, so every case "
                     f"would be one device's step of the {ranks} ranks' batch; add a sharded strategy ("
                     f"{', '.join(sharded)}), or drop {option}")


def check_seq_len_bounds(step: int, max_seq: int | None, model_max: int | None, workload: str) -> None:
    """`--seq-step` and `--max-seq-len` of `--over seq_len` against each other and the longest sequence the model
    takes (`model_max`, its max_position_embeddings; None where it says none): a UsageError naming the option. The
    answer is a multiple of the step up to the longest, so a step past either would be answered with a length the
    user excluded, or refused naming a length the search made up."""
    if max_seq is not None and model_max is not None and max_seq > model_max:
        raise UsageError(f"--max-seq-len {max_seq:,} is longer than {workload} takes: {model_max:,} tokens (its "
                         f"max_position_embeddings); give at most {model_max:,}, or leave it out for that")
    longest = max_seq or model_max
    if longest is not None and step > longest:
        which = f"--max-seq-len {max_seq:,}" if max_seq else f"{workload}'s {model_max:,} (max_position_embeddings)"
        raise UsageError(f"--seq-step {step:,} is longer than the longest sequence, {which}: the answer is a "
                         f"multiple of --seq-step; give a --seq-step of at most {longest:,}")


def check_steps(value: int | None, option: str, minimum: int) -> None:
    """A step count between `minimum` and MAX_STEPS; a UsageError naming `option` and the limit otherwise."""
    if value is None:
        return
    if value < minimum:
        raise UsageError(f"{option} {value}: must be at least {minimum}")
    if value > MAX_STEPS:
        raise UsageError(f"{option} {value} is more than the limit of {MAX_STEPS:,} steps per case; "
                         "a few (3-30) measured steps give a stable median")


def check_cases(cases: list, bind) -> None:
    """Parses and checks every case's strategy against its workload, phase and device before any case runs.

    `bind(case) -> (strategy, context)`. A strategy that cannot apply to one case (Unsupported) is left to become
    that case's row; one that cannot apply anywhere (a UsageError), or an option value that fits none of the run's
    cases (UnsupportedValue in each), stops the run here, naming the case."""
    seen = set()
    value_misfits: dict[str, UnsupportedValue] = {}  # strategy -> why its value fits no case so far
    fitting = set()  # strategies whose values fit at least one case
    for case in cases:
        key = (case.workload, case.strategy, case.phase, case.device, case.batch_size)
        if key in seen:
            continue
        seen.add(key)
        try:
            strategy, context = bind(case)
            strategy.check(context)
            fitting.add(case.strategy)
        except UnsupportedValue as error:
            value_misfits.setdefault(case.strategy, error)
        except Unsupported:
            continue  # the case is a row that says why it cannot run (phase, device): its values say nothing
        except UsageError as error:
            raise UsageError(f"{case.strategy} on {case.workload} ({case.phase}, {case.device}): {error}") from None
    for spec, error in value_misfits.items():
        if spec not in fitting:
            raise UsageError(f"{error}: the value fits none of this run's cases, so nothing was run") from None


@dataclass(frozen=True)
class _MemoryNeed:
    """What one baseline step of a case needs, and the bytes per sample where it was extrapolated (else None)."""

    bytes: int
    per_sample: float | None


def _memory_need(case: Any, baseline_peak: Callable[[Any, int], int]) -> _MemoryNeed:
    """The baseline's peak at the case's batch, measured up to twice MEMORY_PROBE_BATCH, else extrapolated linearly
    from that batch and its double (at small batches the peak is Adam's step, whose size does not grow with the
    batch, so a slope from batches 1 and 2 is far too low)."""
    low, high = MEMORY_PROBE_BATCH, 2 * MEMORY_PROBE_BATCH
    if case.batch_size <= high:
        return _MemoryNeed(baseline_peak(case, case.batch_size), None)
    at_low, at_high = baseline_peak(case, low), baseline_peak(case, high)
    per_sample = max((at_high - at_low) / (high - low), 1.0)
    return _MemoryNeed(int(at_high + per_sample * (case.batch_size - high)), per_sample)


def check_memory(cases: Iterable[Any], baseline_peak: Callable[[Any, int], int]) -> None:
    """On the CPU: for each workload and phase, whether its largest batch fits in this machine's memory.

    `baseline_peak(case, batch_size)`: the baseline's exact tracked peak of `case` at that batch, in bytes (the CLI
    gives bench.analysis.predict's on the meta device: no memory used); where it raises, that case is not checked.
    More than the machine's memory is an error before anything runs (the system would kill the run). The resident
    memory the run will hold (`resident_need`) beyond what this process holds now, more than the machine has free
    now (MemAvailable), is a warning naming both: free memory is a moment's figure on a shared machine (another job
    may end before the largest case starts, or begin after the check), so it warns where the physical memory refuses."""
    memory = machine_memory_bytes()
    if memory is None:
        return
    free, rest = available_bytes(), current_rss_bytes() or 0
    largest: dict[tuple, Any] = {}
    for case in cases:
        if case.device == "cpu":
            key = (case.workload, case.phase, case.data)
            if key not in largest or case.batch_size > largest[key].batch_size:
                largest[key] = case
    for case in largest.values():
        try:
            need = _memory_need(case, baseline_peak)
        except (Exception, SystemExit):  # noqa: BLE001 - a model meta cannot run (or exits): no estimate, no check
            continue
        what = (f"--batch-size {case.batch_size} of {case.workload} ({case.phase}) needs about "
                f"{format_size(need.bytes)} for one baseline step")
        if need.bytes > memory:
            hint = (f"; give a batch size below {int(case.batch_size - (need.bytes - memory) / need.per_sample):,}"
                    if need.per_sample else "")
            raise UsageError(f"{what}, more than this machine's {format_size(memory)} of memory{hint}")
        resident = resident_need(need.bytes, rest)
        holds = (f"the run holds about {format_size(resident)} resident ({RUN_MEMORY_FACTOR:g}x that, plus "
                 f"{format_size(rest)} for the process at rest)")
        if resident > memory:
            warn(f"{what}, and {holds}: more than this machine's {format_size(memory)} of memory; expect `oom` "
                 "rows, or the system ending the run")
        elif free is not None and resident - rest > free:
            warn(f"{what}, and {holds}: {format_size(resident - rest)} more than now, and this machine has "
                 f"{format_size(free)} free (MemAvailable); expect the system to end the run, or free memory first")


def resident_need(counted_peak: int, rest: int) -> int:
    """The resident memory a run of a case whose step counts `counted_peak` holds at most: RUN_MEMORY_FACTOR x
    that (the goal the harness is held to: bench.measure.resident) plus the process at rest `rest`."""
    return int(RUN_MEMORY_FACTOR * counted_peak) + rest


class RunLock:
    """An exclusive lock on a results file for the duration of a run, so two `--resume` of one file cannot both
    run its remaining cases (each would rewrite the file without the other's rows).

    The lock is a hidden `.<name>.lock` beside the CSV (the CSV itself is replaced on every write, so a lock on it
    would not outlive the first case); the kernel releases it when the process dies, even by SIGKILL."""

    def __init__(self, results_path: Path | str):
        results_path = Path(results_path)
        self.path = results_path.with_name(f".{results_path.name}.lock")
        self.results_path = results_path
        self._fd: int | None = None

    def __enter__(self) -> "RunLock":
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise UsageError(f"{str(self.results_path)!r} is being written by another membench run (locked by "
                                 f"{str(self.path)!r}); wait for it to finish, or resume it after it stops") from None
            # the holder before us removes the lock file on exit: a lock on that removed file guards nothing
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            try:
                self.path.unlink(missing_ok=True)
            finally:
                os.close(self._fd)
                self._fd = None


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)
