"""The fake-tensor engine that predict, plan and fit run a case's step on: one steady-state step under the exact
live-tensor tracker on an engine (`fake-cuda`, `fake`, `meta` or `cpu`), the device a strategy is bound to for it, the
meter a strategy's `plan()` measures with when nothing may run on the case's device, and cuBLAS's workspace.

`fake`: PyTorch's fake tensors with the CPU's operators (shapes, dtypes and autocast, no arithmetic;
`bench.run.fake_pass`, which the runner also uses for a 16-bit case the CPU emulates); `fake-cuda`: CUDA's own
operators on fake tensors, in a torch that sees a CUDA device (`bench.measure.fake_cuda_mode`); `meta`: shapes only
(no autocast); `cpu`: a real step.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from bench.measure import breakdown, cuda_allocator, fake_cuda, memory
from bench.measure.op_scratch import OperatorScratch
from bench.measure.fake_allocator import FakeAllocator
from bench.measure.fake_cuda_mode import fake_cuda as fake_cuda_tensors, is_fake_device
from bench.measure.sdpa_kernel import SdpaCalls, SdpaKernelChoice
from bench.run.fake_pass import FakeSession, fake_memory_pass
from bench.run.ranks import fake_process_group, in_rank_process
from bench.run.case import bind_case
from bench.run.runner import MEMORY_WARMUP_STEPS, CaseMeter, forget_traceback, memory_pass
from strategies.framework.composite import recompute_plan_of

__all__ = ["CUDA_BLOCK_BYTES", "FakeSession", "PredictionMeter", "TrackedStep", "UsesAutocast", "bound_device",
           "cublas_workspace", "device_capability", "fake_memory_pass", "has_gpu", "tracked_peak", "tracked_step"]

CUDA_BLOCK_BYTES = 512  # CUDA's caching allocator rounds every block to it


@dataclass
class TrackedStep:
    """One tracked steady-state step: its exact peak of live tensor bytes (rounded per storage to `block_bytes`)
    and, when recorded, the tracker's event log."""

    peak_bytes: int
    events: list | None
    engine: str
    tracker: memory.LiveTensorTracker | None = None  # the tracker that counted it (a snapshot is written from it)
    # the tracker's bytes at its peak by category (`bench.measure.breakdown.CategorizedTracker`)
    peak_by_category: dict = field(default_factory=dict)
    # fake-cuda: the kernels scaled_dot_product_attention ran (`bench.measure.sdpa_kernel`), e.g. "math"
    sdpa_kernel: str | None = None
    # the other engines: how many calls of scaled_dot_product_attention ran the CPU's kernel
    cpu_sdpa_calls: int = 0
    # what the step's backward recomputed (`strategies.framework.composite.recompute_plan_of`); none without a backward
    recompute_plan: str = "none"
    offload_host_peak_bytes: int | None = None  # host memory an offloading strategy's copies held at most
    # a sharded step: each rank's `rank_signature` (known once one rank ran), and the ranks actually traced
    rank_signatures: tuple | None = None
    ranks_traced: tuple[int, ...] = ()
    rank: int | None = None  # a sharded step: the rank it is (the largest peak of those traced)


class UsesAutocast(Exception):
    """Raised by the meta engine when the strategy turns autocast on: meta tensors ignore autocast."""


def _cuda_like_forward(strategy, engine: str):
    """The strategy's forward context, with CPU autocast switched to float16 (CUDA's autocast dtype)."""
    original = strategy.forward

    @contextlib.contextmanager
    def forward():
        with original():
            if torch.is_autocast_enabled("cpu"):
                if engine == "meta":
                    raise UsesAutocast()
                with torch.autocast("cpu", dtype=torch.float16):
                    yield
            else:
                yield

    return forward


def bound_device(engine: str) -> str:
    """The device a strategy is bound to for a step on `engine`: CUDA for fake-cuda, else the CPU (the fake and
    meta engines run the CPU-bound strategy on their own tensors)."""
    return "cuda" if engine == "fake-cuda" else "cpu"


def tracked_step(case, spec: str, engine: str = "fake", block_bytes: int = 1, cuda_autocast: bool = True,
                 ranks: int = 1, record_events: bool = False, warmup_steps: int | None = None,
                 planned=None, capability: tuple[int, int] | None = None, every_rank: bool = False,
                 rank_strategy: Callable[[int], Any] | None = None, repeat_warmup: bool = False) -> TrackedStep:
    """One steady-state step of `case` tracked on `engine` (fake-cuda, fake, meta or cpu: the case's device is
    ignored but by fake-cuda, which needs a fake CUDA device in this process); for a sharded strategy, the rank with
    the largest peak of its `ranks` ranks, each run in turn in this process as that rank of PyTorch's fake process
    group, on `engine` (cpu, or fake-cuda: FSDP2 runs on fake tensors, DDP with strategies/framework/sharding.py's
    help; shards of the batch and of parameters differ by rank). `planned`: the strategy bound to the engine's device
    whose `plan()` has run (a checkpoint budget's plan), used as it is. On fake-cuda each call of
    scaled_dot_product_attention runs the kernel CUDA would choose on a device of `capability` (default: the device
    torch sees; `bench.measure.sdpa_kernel`), named in the step's `sdpa_kernel`. A fake-cuda step that records its
    events prepares its breakdown before its last warm-up step as well (`memory_pass`'s `steady_warmup`: that step's
    log is then the measured step's), and with `repeat_warmup` builds the measured step's log from it instead of
    running it (bench.analysis.layer_replay's smaller traces, whose result it proves).

    Of a sharded strategy's ranks, one of each `rank_signature` is traced (ranks that hold chunks and batch shares of
    the same sizes allocate the same: tests/test_rank_signature.py compares with every rank traced, to the byte);
    `every_rank` traces them all. The step says which ranks ran (`ranks_traced`) and which it is (`rank`);
    `rank_strategy(rank)`, where given, makes the strategy each rank runs (bound and planned, as `planned`)."""
    device = bound_device(engine)
    strategy = planned if planned is not None else bind_case(replace(case, strategy=spec, device=device), ranks)[0]
    if strategy.distributed and not in_rank_process():
        return _largest_rank(case, spec, engine, block_bytes, cuda_autocast, ranks, record_events, warmup_steps,
                             capability, device, every_rank, rank_strategy)
    if cuda_autocast and engine != "fake-cuda":
        strategy.forward = _cuda_like_forward(strategy, engine)
    tracker = breakdown.CategorizedTracker("meta" if engine == "meta" else device, block_bytes=block_bytes,
                                           record_events=record_events)
    if case.device == "cuda":  # the GPU asked for, else the device torch sees (a GPU's, or the fake-CUDA stubs')
        tracker.op_workspace = OperatorScratch(capability or (torch.cuda.get_device_capability(0)
                                                              if torch.cuda.is_available() else None))
    # the peak only: no step after the measured one (mem_growth_bytes_per_step is not predicted)
    options = {"warmup_steps": warmup_steps, "growth_steps": 0, "prepare": _file_logits}
    attention = cpu_attention = None
    if engine == "fake-cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("the fake-cuda engine runs in a torch that sees a CUDA device: a GPU's, or the "
                               f"stubs' fake one of the fake-CUDA environment ({fake_cuda.VENV.name})")
        # no capacity: a prediction may exceed the device torch sees (the stubs' 80 GiB, or this GPU's)
        attention = SdpaKernelChoice(capability)
        steady = record_events and steady_warmup_possible(engine, warmup_steps)
        with fake_cuda_tensors(allocator=FakeAllocator(limit_bytes=sys.maxsize, counted_by=tracker), inner=[attention]):
            measured = memory_pass(replace(case, device="cuda"), strategy, tracker=tracker, steady_warmup=steady,
                                   repeat_warmup=repeat_warmup and steady, **options)
    else:
        # a CUDA case on the CPU's operators: its attention calls are counted (they run the CPU's kernel)
        cpu_attention = SdpaCalls() if case.device == "cuda" else None
        with cpu_attention or contextlib.nullcontext():
            if engine == "fake":
                # the CPU kernels' storages for a CPU figure; CUDA's kernels return the meta kernels' ones
                measured = fake_memory_pass(replace(case, device="cpu"), strategy, tracker=tracker,
                                            cpu_kernels=not cuda_autocast, **options)
            else:
                measured = memory_pass(replace(case, device=engine), strategy, tracker=tracker, **options)
    signatures = tuple(strategy.rank_signature(rank, ranks) for rank in range(ranks)) if in_rank_process() else None
    return TrackedStep(int(measured["peak_mem_bytes"]), tracker.events if record_events else None, engine, tracker,
                       dict(tracker.peak_by_category),
                       (attention.summary() or None) if attention is not None else None,
                       cpu_attention.calls if cpu_attention is not None else 0,
                       recompute_plan_of(strategy) if case.phase == "train" else "none",
                       strategy.columns().get("offload_host_peak_bytes"), signatures)


def steady_warmup_possible(engine: str, warmup_steps: int | None) -> bool:
    """Whether `tracked_step` on `engine` runs its last warm-up step as the measured one (two warm-up steps or more on
    fake-cuda), so that `repeat_warmup` can build the measured step from it."""
    return engine == "fake-cuda" and (MEMORY_WARMUP_STEPS["cuda"] if warmup_steps is None else warmup_steps) >= 2


def _largest_rank(case, spec: str, engine: str, block_bytes: int, cuda_autocast: bool, ranks: int,
                  record_events: bool, warmup_steps: int | None, capability, device: str,
                  every_rank: bool, rank_strategy: Callable[[int], Any] | None) -> TrackedStep:
    """The step of the rank with the largest peak, each rank run in turn in this process as that rank of PyTorch's
    fake process group (on fake-cuda the group, as NCCL, serves CUDA tensors only); a rank whose signature an
    earlier rank had is not run again (see `tracked_step`)."""
    def run(rank: int) -> TrackedStep:
        with fake_process_group(ranks, rank, device="cuda" if device == "cuda" else None):
            step = tracked_step(case, spec, engine, block_bytes, cuda_autocast, ranks, record_events,
                                warmup_steps, planned=rank_strategy(rank) if rank_strategy else None,
                                capability=capability)
        step.rank = rank
        return step

    steps = one_rank_of_each_signature(ranks, run, lambda step: step.rank_signatures, every_rank)
    return replace(max(steps.values(), key=lambda step: step.peak_bytes), ranks_traced=tuple(steps))


def one_rank_of_each_signature(ranks: int, run: Callable[[int], Any], signatures_of: Callable[[Any], tuple | None],
                               every_rank: bool = False) -> dict[int, Any]:
    """{rank: run(rank)} for the ranks a sharded step traces, in order: each rank whose `rank_signature` no earlier
    traced rank had (every rank with `every_rank`), the signatures read from the first result (`signatures_of`)."""
    results: dict[int, Any] = {}
    seen: set = set()
    signatures = None
    for rank in range(ranks):
        signature = signatures[rank] if signatures is not None else None
        if not every_rank and signature is not None and signature in seen:
            continue
        results[rank] = run(rank)
        signatures = signatures or signatures_of(results[rank])
        if signatures is not None and signatures[rank] is not None:
            seen.add(signatures[rank])
    return results


def _file_logits(session, tracker: breakdown.CategorizedTracker) -> None:
    """Before the measured step: the logits of the case's output head (a causal language model's) are filed as
    such from now on, the previous step's kept output among them."""
    head = session.workload.output_head(session.base_model)
    if isinstance(head, torch.nn.Linear):
        tracker.logits_features = head.out_features
        kept = session.kept.get("predicted")
        if isinstance(kept, torch.Tensor) and kept.dim() >= 2 and kept.shape[-1] == head.out_features:
            tracker.recategorize([kept], breakdown.LOGITS)


# the least a training step holds per byte of weights: the weights, their gradients and AdamW's two moments
TRAINING_BYTES_PER_WEIGHT_BYTE = 4


def real_step_refusal(workload, phase: str) -> str | None:
    """Why a real CPU step of `workload`'s model must not run where the fake engines cannot run a strategy: its
    weights (with their gradients and AdamW's two moments in training), counted on a model that holds no memory,
    exceed the memory this machine can give now (MemAvailable); None where it may run or nothing says otherwise."""
    from bench.core.units import format_size
    from bench.measure.resident import available_bytes

    free = available_bytes()
    if workload is None or free is None:
        return None
    weights = sum(p.numel() * p.element_size() for p in workload.model_structure().parameters())
    needed = weights * (TRAINING_BYTES_PER_WEIGHT_BYTE if phase == "train" else 1)
    if needed <= free:
        return None
    held = "weights, gradients and AdamW's state" if phase == "train" else "weights"
    return (f"a real CPU step instead would hold at least {format_size(needed)} ({held}), more than the "
            f"{format_size(free)} this machine has free: not run")


def tracked_peak(case, spec: str, engine: str = "fake", block_bytes: int = CUDA_BLOCK_BYTES,
                 cuda_autocast: bool = True, ranks: int = 1) -> int:
    """The tracked peak of one steady-state step of `case` on `engine` (see `tracked_step`)."""
    return tracked_step(case, spec, engine, block_bytes, cuda_autocast, ranks).peak_bytes


def has_gpu() -> bool:
    """Whether this process sees a real CUDA device (not the fake-CUDA environment's stubs)."""
    return torch.cuda.is_available() and not is_fake_device()


def device_capability() -> tuple[int, int] | None:
    """The compute capability of this machine's CUDA device 0, or None without a GPU."""
    if has_gpu():
        return torch.cuda.get_device_capability(0)
    return None


def cublas_workspace(capability: tuple[int, int] | None) -> int:
    """cuBLAS's workspace per handle and stream: PyTorch's own figure where this torch can say it (a CUDA build
    with a GPU), else CUBLAS_WORKSPACE_CONFIG or the default for `capability`."""
    if has_gpu() and hasattr(torch.backends.cuda, "cublas_workspace_size"):
        return int(torch.backends.cuda.cublas_workspace_size())
    return cuda_allocator.workspace_from_environment(capability)


class PredictionMeter(CaseMeter):
    """What a strategy's `plan()` measures, for predict: nothing runs on the case's device, so the peaks it would
    measure (the baseline's, a candidate plan's) are predicted as well."""

    def __init__(self, case):
        super().__init__(replace(case, device="cpu"))

    def predicted_peak(self, strategy) -> int:
        """On the meta device; where meta cannot run the strategy (the fused Adam step), on fake tensors: never a
        real step, which at full size would hold the model for real. The peak only: no growth step after it."""
        try:
            measured = memory_pass(replace(self.case, device="meta"), strategy,
                                   tracker=memory.LiveTensorTracker("meta"), growth_steps=0)
        except Exception as error:  # noqa: BLE001 - a strategy meta cannot run: the fake tensors' step
            forget_traceback(error)
            measured = fake_memory_pass(self.case, strategy, growth_steps=0)
        return int(measured["peak_mem_bytes"])

    def measured_peak(self, strategy) -> int:
        return self.predicted_peak(strategy)
