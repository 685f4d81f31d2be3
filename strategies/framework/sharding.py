"""What the sharded-training strategies (ddp, zero1, fsdp) share: the rank's slice of the batch, the loss across ranks.

A sharded case runs as `--ranks N` processes of torch.distributed (gloo on the CPU, NCCL on CUDA), launched by
bench.run.ranks as torchrun would; each process trains on its 1/N of the step's global batch, so a sharded step
computes what one process computes on the whole batch (the mean of equal shards' mean losses is the global mean),
which is what its row is verified against. BatchNorm is the exception: each rank normalises its own shard, so a
BatchNorm model's statistics and gradients differ from the single process's (its row says so).
"""

from __future__ import annotations

import contextlib
import time
import weakref

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from bench.core.errors import Unsupported
from bench.core.memory_categories import COMMUNICATION, allocating, file_as
from strategies.framework.base import Strategy


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of ranks (0 and 1 outside torch.distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def data_parallel_replicas(strategy: Strategy, ranks: int) -> int:
    """Over how many data-parallel replicas the step's batch is split on `ranks` ranks under `strategy` (composed or
    not): the ranks, unless a member's groups share samples (tp's, cp's: `Sharded.data_parallel_place`)."""
    return min((m.data_parallel_place(0, ranks)[1] for m in getattr(strategy, "members", [strategy])
                if isinstance(m, Sharded)), default=ranks)


# how the tracker files a storage it first sees as an operator's input (bench.measure.memory): gloo's own buffers
UNTRACKED = "untracked"


def gloo_copy_of_input(input_tensor, group=None):
    """Under PyTorch's fake process group, on real host tensors (the CPU engine's prediction of gloo ranks): a buffer
    of the reduce-scatter input's size and dtype, which the caller holds until the collective's wait() returns.

    gloo's reduce-scatter works on a copy of its input of its own, which its wait() copies the rank's chunk out of
    in the calling thread (where the tracker first sees it, as that copy's input: `untracked`, among the
    temporaries) and which is freed by the end of the wait (`issued_and_released`). The fake group allocates
    nothing, so without it a CPU prediction misses these bytes where they are at the peak (a mixed-precision
    step's, whose 16-bit activations sit lower: tests/test_ranks.py). Nothing on fake tensors (a prediction of
    NCCL, which reduces in the buffers it is given) or under a real group (gloo allocates its own); None then."""
    if input_tensor.device.type != "cpu" or is_fake(input_tensor) or "fake" not in dist.get_backend(group):
        return None
    with allocating(UNTRACKED):
        return torch.empty_like(input_tensor)


SETTLE_SECONDS = 1.0  # the longest a collective's end waits for gloo's thread to let go of its tensors


class StoragesSeen(TorchDispatchMode):
    """Weak references to the storages of every tensor an operator takes or makes in this thread while entered."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.storages.setdefault(storage._cdata, weakref.ref(storage))
        return out


def issued_and_released(issue, tensors, group):
    """`issue(*tensors)`'s work, and `settle(released, seen)`, which makes the collective's buffers freed where the
    program drops them rather than where gloo's worker thread does.

    gloo's worker holds a work, and with it what the work holds, from the moment it marks the work done (which ends
    `wait()`) until it takes its next one: the tensors it was given (the all-gather's flat buffer) and buffers of its
    own (the reduce-scatter's copy of its input, which `wait()` copies into the output in the calling thread). FSDP2
    drops the flat all-gather output right after its copy-out, so whether that buffer lived on into the next unit's
    all-gather (two flat buffers alive at once: 17,920 B more at gpt_mini's peak, in one run of eight on a busy
    2-core AMD EPYC) was up to the threads, and so was the reduce-scatter's copy (6,528 B more at
    fsdp+checkpoint's peak, one run in eight). The work gets aliases of the tensors (views, the same storage) that
    nothing else holds; `settle` drops this process's reference to the work and waits, at most SETTLE_SECONDS,
    until those aliases are gone and so is every other storage `wait()` used (`seen`) but the tensors' own: the
    work is destroyed, and each buffer is freed where the program drops it, as under PyTorch's fake process group
    (whose works hold nothing) in a prediction. Only gloo's works are waited for (NCCL's are held by its watchdog
    thread, which a GPU's figures, max_memory_allocated, do not wait for either)."""
    if dist.get_backend(group) != "gloo":
        return issue(*tensors), lambda released, seen: None
    own = {t.untyped_storage()._cdata for t in tensors}
    aliases = [t.view(t.shape) for t in tensors]
    held = [weakref.ref(alias) for alias in aliases]
    work = issue(*aliases)
    del aliases

    def settle(released, seen) -> None:
        released.work = None  # this process's last reference to the work: gloo's thread may hold another
        held.extend(ref for key, ref in seen.items() if key not in own)
        deadline = time.monotonic() + SETTLE_SECONDS
        while any(ref() is not None for ref in held) and time.monotonic() < deadline:
            time.sleep(0)

    return work, settle


def check_divides_ranks(option: str, value: int, ranks: int) -> None:
    """An `unsupported` row where a mesh dimension's size `value` (named `option`, e.g. `tp:degree`) does not divide
    --ranks, naming the sizes that do."""
    if ranks % value:
        valid = [d for d in range(1, ranks + 1) if ranks % d == 0]
        raise Unsupported(f"{option}={value} does not divide --ranks {ranks}; valid choices: "
                          f"{', '.join(map(str, valid))}")


class Sharded(Strategy):
    """Base of the strategies that run as several ranks (not registered itself)."""

    phases = ("train",)
    refusals = (r"is sharded training: it needs --ranks 2 or more",)  # tests_cuda_fake/test_sharded_cuda.py runs 2
    distributed = True
    global_samples = 0  # the step's global batch, once `shard_batch` split it
    # the sharded strategies it composes with (on one mesh: tp's dp x tp, where fsdp shards over dp); any other two
    # sharded strategies split the same ranks two ways and are refused (strategies.framework.composite)
    shards_with: tuple[str, ...] = ()

    @classmethod
    def plan_settings(cls, space):
        """Tried only where the plan is for several ranks (--ranks 2 or more)."""
        return [{}] if space.context.ranks > 1 else []

    def check(self, context):
        super().check(context)
        if context.ranks < 2:
            raise Unsupported(f"{self.name} is sharded training: it needs --ranks 2 or more, not {context.ranks}")

    def shard_batch(self, batch):
        """This rank's slice of the global batch; an uneven split gives the first ranks one sample more (as
        `torch.tensor_split` does), and then the gradients weigh samples unequally: the row will not match."""
        place, replicas = self.data_parallel_place(*rank_and_world())
        self.global_samples = len(batch[1])
        if len(batch[1]) < replicas:
            raise Unsupported(f"batch {len(batch[1])} is smaller than the {replicas} data-parallel ranks "
                              f"(--global-batch-size is split across them; --batch-size 1 gives each one sample)")
        batch = tree_map(lambda t: torch.tensor_split(t, replicas)[place] if isinstance(t, torch.Tensor) else t, batch)
        return self.shard_sequence(batch)

    def shard_sequence(self, batch):
        """This rank's part of each sample's sequence: all of it, unless a strategy splits the sequence across its
        ranks (context parallelism)."""
        return batch

    def data_parallel_place(self, rank: int, world: int) -> tuple[int, int]:
        """(which slice of the batch rank `rank` of `world` trains on, how many slices): its own of `world`, unless
        a strategy whose ranks share samples (tensor parallelism's groups) says otherwise."""
        return rank, world

    def samples_of_rank(self, rank: int, world: int) -> int:
        """How many samples of the step's global batch rank `rank` trains on (`shard_batch`'s split)."""
        place, replicas = self.data_parallel_place(rank, world)
        samples = self.global_samples
        return samples // replicas + (1 if place < samples % replicas else 0)

    def rank_signature(self, rank, world):
        """None (each rank traced on its own): a subclass whose ranks differ only by what they hold says what."""
        return None

    def reduce_loss(self, loss):
        """The mean of the ranks' losses; the number travels on the case's device, since NCCL (CUDA's backend)
        has no collective for host tensors."""
        _, world = rank_and_world()
        if world == 1:
            return loss
        total = torch.tensor([loss], dtype=torch.float64, device=self.context.device)
        dist.all_reduce(total)
        return float(total) / world


class _DistributedDataParallel(DistributedDataParallel):
    """DistributedDataParallel whose forward's own work is filed as communication in the breakdown
    (`bench.core.memory_categories`): `_pre_forward` is where DDP allocates its gradient buckets anew (the reducer
    rebuilds them in the second iteration's forward, in the order the first backward made the gradients, and frees
    the first ones, made at construction before any tracker) and broadcasts the module's buffers. The training
    itself is DistributedDataParallel's."""

    def _pre_forward(self, *inputs, **kwargs):
        with allocating(COMMUNICATION):
            return super()._pre_forward(*inputs, **kwargs)


@contextlib.contextmanager
def _shapes_not_verified():
    """DDP's construction without `_verify_param_shape_across_processes`: that check (C++) reads the data of a tensor of
    every parameter's shape to compare them across the ranks, which fake tensors do not have; in one process of
    PyTorch's fake process group every rank is this one, so it could only agree."""
    from torch.nn.parallel import distributed as ddp_module

    verify = ddp_module._verify_param_shape_across_processes
    ddp_module._verify_param_shape_across_processes = lambda process_group, tensors, logger=None: None
    try:
        yield
    finally:
        ddp_module._verify_param_shape_across_processes = verify


def data_parallel(model):
    """`DistributedDataParallel(model)` (its buckets filed as communication: `_DistributedDataParallel`); under
    PyTorch's fake process group (bench.analysis.predict: collectives move no data) a comm hook that returns the
    gradient bucket as it is stands in for the all-reduce, which would write into that same bucket (the fake
    group's own all-reduce returns nothing DDP can use). The hook still issues the bucket's all-reduce on the fake
    group, which moves nothing and allocates nothing, so that a dispatch mode sees it as the real one is issued
    (`plan`'s step time counts it: `bench.measure.op_cost`)."""
    fake_group = "fake" in dist.get_backend().replace(",", ":").split(":")  # "fake", or "cuda:fake" (CUDA only)
    on_fake = any(is_fake(p) for p in model.parameters())
    with _shapes_not_verified() if on_fake else contextlib.nullcontext():
        wrapped = _DistributedDataParallel(model)
    rebuild = _BucketsRebuiltInPlace(wrapped.reducer) if on_fake else None
    if fake_group:
        def reduced_in_place(state, bucket):
            if rebuild is not None:
                rebuild.buffers[bucket.index()] = bucket.buffer()
            dist.all_reduce(bucket.buffer(), group=wrapped.process_group)
            future = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future

        wrapped.register_comm_hook(None, reduced_in_place)
    if rebuild is not None:
        wrapped.reducer = rebuild
    return wrapped


class _BucketsRebuiltInPlace:
    """DDP's reducer on fake tensors, but for the rebuild of its gradient buckets in the second iteration's forward.
    The C++ rebuild reads a host tensor of bucket indices that it makes and synchronises across the ranks, which a fake
    tensor cannot give. The real rebuild allocates new buckets for the same gradients (grouped by DDP's size caps in
    the order the first backward made them) and frees the first ones, made at construction before any tracker; here
    the first ones (seen by the fake process group's comm hook in the first backward) are filed as the communication
    buffers allocated at that point: the same bytes (tests/test_ranks.py: equal to the real rebuild's, to the byte,
    on the CPU)."""

    def __init__(self, reducer):
        self._reducer = reducer
        self.buffers: dict[int, torch.Tensor] = {}
        self._rebuilt = False

    def __getattr__(self, name):
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        if self._rebuilt or not self.buffers:
            return False
        file_as(self.buffers.values(), COMMUNICATION)
        self._rebuilt = True
        return True
