"""A mechanism model of DeepSpeed's ZeRO stages 2 and 3: what its engine allocates per rank, and when, in plain torch.

membench does not run DeepSpeed's engine (it is not a dependency, and its CUDA-only kernels do not run on fake
tensors); it runs the same partitioning with torch's own tensors and collectives, so that one process under PyTorch's
fake process group steps through one rank's allocations (`predict --ranks N`) and real gloo ranks run the same code
(`compare --ranks N`). What it allocates follows DeepSpeed 0.19.8 (deepspeed/runtime/zero/):

ZeRO-2 (stage_1_and_2.py, `DeepSpeedZeroOptimizer`), per optimizer parameter group:
- the group's trainable parameters flattened into one buffer of their dtype (`bit16_groups_flat`, padded to a
  multiple of 2 x ranks elements: `nccl_start_alignment_factor`), each parameter a view of it
  (`_update_model_bit16_weights`);
- this rank's float32 master copy of its 1/N of that buffer (`single_partition_of_fp32_groups`:
  `.detach().clone().to(device, float32)`), on the host with `offload_optimizer=cpu`; the optimizer (the workload's
  class and settings) steps that copy, so its state is 1/N too;
- in each backward, `reduce_bucket_size` elements of the gradients' dtype as the bucket (`setup_buckets`; a second one
  with `overlap_comm`), each gradient copied into it as it is accumulated and all-reduced when the next one would not
  fit (`reduce_independent_p_g_buckets_and_remove_grads`); a gradient larger than the bucket is reduced where it is.
  After a bucket's reduction the gradients of the parameters in this rank's partition are copied into one buffer
  (`grads_in_partition`: whole parameters, every parameter that overlaps the partition, allocated once and kept by
  the gradients' views), the others freed; with `offload_optimizer=cpu` the partition's share goes straight into a
  float32 buffer on the host, kept between steps as the master's gradient, and no 16-bit gradient stays;
- in the step, the partition's gradients flattened in their dtype (`get_flat_partition`, partition size) and
  converted to float32 (`single_grad_partition`), the parameters' gradients freed, the optimizer stepped, the master
  copied back into the 16-bit partition and the flat buffer all-gathered in place (`all_gather_dp_groups`).

ZeRO-3: strategies/framework/deepspeed_zero3.py.

The parameters' dtype is the model's: DeepSpeed's `bf16`/`fp16` sections cast the module to 16 bits (membench's
`bf16_weights` before this strategy), else float32, whose master copy is then a second float32 copy, as DeepSpeed's.
The buffers of the buckets and of the all-gathers are filed as communication and weights in the breakdown; the
master copies with the optimizer's state; the gradient buffers as gradients.
"""

from __future__ import annotations

import inspect
import math
import warnings

import torch
import torch.distributed as dist
from torch import nn

from bench.core.errors import Unsupported, UsageError
from bench.core.memory_categories import COMMUNICATION, WEIGHTS, allocating, file_as, listening
from strategies.framework.sharding import Sharded, StoragesSeen, issued_and_released, rank_and_world

# an embedding's input (token ids) needs no gradient, so its backward hook fires at its output's gradient: expected
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect to "
                                          "module outputs since no inputs require gradients")
# torch 2.13's names of the flat collectives; the older ones (all_gather_into_tensor, reduce_scatter_tensor) warn
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

OFFLOAD_CHOICES = ("none", "cpu")
ALIGNMENT_PER_RANK = 2  # stage_1_and_2.py's nccl_start_alignment_factor: the flat buffer pads to 2 x ranks elements
OPTIMIZER_STATE = "optimizer_state"  # the tracker's category of the optimizer's state (bench.measure.breakdown)
GRADS = "grads"
DEFAULT_REDUCE_BUCKET_ELEMENTS = 500_000_000  # DeepSpeedZeroConfig.reduce_bucket_size
DEFAULT_SUB_GROUP_ELEMENTS = 1_000_000_000  # DeepSpeedZeroConfig.sub_group_size


def _rebuilt_optimizer(optimizer: torch.optim.Optimizer, masters: list[list[torch.Tensor]]) -> torch.optim.Optimizer:
    """The workload's optimizer class and settings over `masters`, a list of them per parameter group in order."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [{**{k: v for k, v in group.items() if k != "params" and k in accepted}, "params": list(tensors)}
              for group, tensors in zip(optimizer.param_groups, masters)]
    return type(optimizer)(groups, **settings)


class _Work:
    """Holds a collective's work: the only reference this process keeps, which `settle` drops."""

    work = None


def _collective(issue, *tensors) -> None:
    """`issue(*tensors, async_op=True)` waited for until gloo's worker thread has let go of every tensor it was given
    or made for it (`strategies.framework.sharding.issued_and_released`): otherwise a buffer this stage drops right
    after its collective (the reduce-scatter's share, the all-gather's input) lives on in gloo's thread until its
    next collective, into the next step's peak on some ranks and not others, as the threads decide."""
    held = _Work()
    held.work, settle = issued_and_released(lambda *ts: issue(*ts, async_op=True), tensors, None)
    with StoragesSeen() as seen:
        held.work.wait()
    settle(held, seen.storages)


def _master_of(partition: torch.Tensor, offload: bool) -> nn.Parameter:
    """A float32 copy of `partition` (on the host with offload), as DeepSpeed makes it: clone, then convert."""
    device = "cpu" if offload else partition.device
    return nn.Parameter(partition.detach().clone().to(device=device, dtype=torch.float32))


class _Bucket:
    """The gradients waiting for their reduction: the buffer(s) of `size` elements, what is in the current one."""

    def __init__(self, size: int, dtype: torch.dtype, device, count: int):
        with allocating(COMMUNICATION):
            self.buffers = [torch.empty(size, dtype=dtype, device=device) for _ in range(count)]
        self.size = size
        self.index = 0
        self.elements = 0
        self.params: list[nn.Parameter] = []

    def take(self, param: nn.Parameter) -> None:
        """The parameter's gradient copied into the bucket and its `.grad` made a view of it (its own freed)."""
        if param.numel() > self.size:  # reduced where it is (`extra_large_param_to_reduce`)
            self.params.append(param)
            return
        view = self.buffers[self.index].narrow(0, self.elements, param.numel())
        view.copy_(param.grad.reshape(-1))
        param.grad = view.view_as(param.grad)
        self.elements += param.numel()
        self.params.append(param)

    def fits(self, param: nn.Parameter) -> bool:
        return self.elements + param.numel() <= self.size

    def emptied(self) -> list[nn.Parameter]:
        params, self.params, self.elements = self.params, [], 0
        self.index = (self.index + 1) % len(self.buffers)  # overlap_comm's second buffer, if any
        return params


class DeepSpeedZero(Sharded):
    """Base of `zero2` and `zero3` (not registered itself): the options both stages share and the verification's
    view of the partitioned gradients and parameters."""

    stage = 0
    options = {"reduce_bucket_size": DEFAULT_REDUCE_BUCKET_ELEMENTS, "overlap_comm": False,
               "contiguous_gradients": True, "offload_optimizer": "none"}
    row_columns = ("offload_host_peak_bytes",)  # filled with offload_optimizer=cpu (offload_param=cpu) only
    refusals = (*Sharded.refusals, r"offload to cpu needs device cuda")
    prediction_note = ("DeepSpeed's engine is not run: its ZeRO partitioning is modelled (strategies/framework/"
                       "deepspeed_zero.py); its own kernels' workspaces are not counted")

    def __init__(self, **options):
        super().__init__(**options)
        for option in ("offload_optimizer", "offload_param"):
            if option in self.settings and self.settings[option] not in OFFLOAD_CHOICES:
                raise UsageError(f"{self.name}:{option}={self.settings[option]!r}; valid choices: "
                                 f"{', '.join(OFFLOAD_CHOICES)}")
        for option, value in self.settings.items():
            if isinstance(value, int) and not isinstance(value, bool) and value < 0:
                raise UsageError(f"{self.name}:{option}={value}; valid: a number of elements, 0 or more")
        if self.settings["reduce_bucket_size"] < 1:
            raise UsageError(f"{self.name}:reduce_bucket_size={self.settings['reduce_bucket_size']}; valid: a number "
                             "of elements, 1 or more (DeepSpeed's default 500000000)")
        self.host_peak_bytes = 0
        self.optimizer = None

    def check(self, context):
        super().check(context)
        if context.device == "cpu" and any(self.settings.get(o) == "cpu" for o in ("offload_optimizer",
                                                                                   "offload_param")):
            raise Unsupported(f"{self.name}: offload to cpu needs device cuda, not cpu: on the CPU the host is the "
                              "device, so the offload saves nothing")

    @property
    def offload_optimizer(self) -> bool:
        return self.settings["offload_optimizer"] == "cpu"

    def _bucket(self, dtype: torch.dtype, device) -> _Bucket:
        return _Bucket(self.settings["reduce_bucket_size"], dtype, device, 2 if self.settings["overlap_comm"] else 1)

    def _file_state(self, module, args) -> None:
        """A forward pre-hook on the model: the persistent buffers filed for the breakdown (they were made before
        any tracker, and a tracker sees a storage first as an operator's input)."""
        if listening():
            for tensors, category in self.persistent_buffers():
                file_as(tensors, category)

    def persistent_buffers(self) -> list[tuple[list[torch.Tensor], str]]:
        """(tensors, the tracker's category) of what the stage keeps between steps."""
        raise NotImplementedError

    def columns(self):
        return {"offload_host_peak_bytes": self.host_peak_bytes} if self.host_peak_bytes else {}

    def _count_host_bytes(self) -> None:
        storages = {}
        for tensors, _ in self.persistent_buffers():
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        for state in self.optimizer.state.values():
            for t in state.values():
                if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim():
                    storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        self.host_peak_bytes = max(self.host_peak_bytes, sum(storages.values()))

    def zero_grad(self, optimizer):
        """Nothing: the stage frees the gradients itself (DeepSpeed's engine.step clears them)."""

    def differs_by_design(self):
        return None


class _Group:
    """One optimizer parameter group of ZeRO-2: its flat buffer, this rank's partition and master, the parameters
    that overlap the partition."""

    def __init__(self, params: list[nn.Parameter], rank: int, world: int, offload: bool):
        self.params = params
        numel = sum(p.numel() for p in params)
        align = ALIGNMENT_PER_RANK * world
        padded = -(-numel // align) * align
        first = params[0]
        self.flat = torch.zeros(padded, dtype=first.dtype, device=first.device)
        offset, self.offsets = 0, []
        for p in params:
            self.flat.narrow(0, offset, p.numel()).copy_(p.detach().reshape(-1))
            self.offsets.append(offset)
            offset += p.numel()
        for p, start in zip(params, self.offsets):
            p.data = self.flat.narrow(0, start, p.numel()).view_as(p)
        self.partition_numel = padded // world
        self.start = rank * self.partition_numel
        self.partition = self.flat.narrow(0, self.start, self.partition_numel)
        self.master = _master_of(self.partition, offload)
        end = self.start + self.partition_numel
        self.in_partition = [(p, o) for p, o in zip(params, self.offsets) if o < end and o + p.numel() > self.start]
        self.grads_numel = sum(p.numel() for p, _ in self.in_partition)
        self.grads: torch.Tensor | None = None  # grads_in_partition
        self.grads_offset = 0
        # with offload, the partition's gradients go straight into a float32 buffer on the host, kept as the
        # master's gradient (`initialize_optimizer_states` with cpu_offload, `async_inplace_copy_grad_to_fp32_buffer`)
        self.host_grad = torch.zeros(self.partition_numel, dtype=torch.float32, device="cpu") if offload else None


class Zero2Mechanism(DeepSpeedZero):
    """ZeRO-2's allocations (module docstring): flat 16-bit parameters, 1/N float32 masters and optimizer state,
    gradients reduced through the bucket and kept for this rank's partition only."""

    stage = 2

    def wrap_optimizer(self, optimizer, model):
        rank, world = rank_and_world()
        self.rank, self.world = rank, world
        self.groups = []
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.requires_grad]
            if not params:
                raise Unsupported(f"{self.name}: an optimizer parameter group without trainable parameters")
            self.groups.append(_Group(params, rank, world, self.offload_optimizer))
        self.group_of = {id(p): g for g in self.groups for p in g.params}
        self.whole_grads = False
        self.bucket = None
        for g in self.groups:
            for p in g.params:
                p.register_post_accumulate_grad_hook(self._gradient_ready)
        model.register_forward_pre_hook(self._file_state)
        self.optimizer = _rebuilt_optimizer(optimizer, [[g.master] for g in self.groups])
        return self.optimizer

    def rank_signature(self, rank, world):
        """A rank holds the same flat buffer and partition size as every other; what differs is its share of the
        batch and the gradients it keeps: the whole parameters that overlap its partition."""
        kept = []
        for g in self.groups:
            start, end = rank * g.partition_numel, (rank + 1) * g.partition_numel
            kept.append(sum(p.numel() for p, o in zip(g.params, g.offsets) if o < end and o + p.numel() > start))
        return ("samples", self.samples_of_rank(rank, world), "grads", tuple(kept))

    def persistent_buffers(self):
        return [([g.flat for g in self.groups], WEIGHTS), ([g.master for g in self.groups], OPTIMIZER_STATE),
                ([g.grads for g in self.groups if g.grads is not None], GRADS),
                ([g.host_grad for g in self.groups if g.host_grad is not None], GRADS)]

    def backward(self, loss):
        first = self.groups[0].params[0]
        self.bucket = self._bucket(first.dtype, first.device) if self.settings["contiguous_gradients"] else None
        self.pending: list[nn.Parameter] = []
        loss.backward()
        self._reduce()
        self.bucket = None  # `_release_ipg_buffers`

    def _gradient_ready(self, param: nn.Parameter) -> None:
        if self.bucket is None:
            self.pending.append(param)
            return
        if not self.bucket.fits(param) and self.bucket.params:
            self._reduce()
        self.bucket.take(param)

    def _reduce(self) -> None:
        """The bucket's gradients averaged across the ranks; those of this rank's partition kept, the others freed."""
        params = self.bucket.emptied() if self.bucket is not None else self.pending
        self.pending = []
        for p in params:
            _collective(dist.all_reduce, p.grad)
            p.grad.div_(self.world)
            group = self.group_of[id(p)]
            if not any(q is p for q, _ in group.in_partition):
                p.grad = None
                continue
            if group.host_grad is not None:
                offset = next(o for q, o in group.in_partition if q is p)
                lo, hi = max(offset, group.start), min(offset + p.numel(), group.start + group.partition_numel)
                group.host_grad[lo - group.start:hi - group.start].copy_(p.grad.reshape(-1)[lo - offset:hi - offset])
                p.grad = None
                continue
            if group.grads is None:
                with allocating(GRADS):
                    group.grads = torch.empty(group.grads_numel, dtype=p.dtype, device=p.device)
                group.grads_offset = 0
            view = group.grads.narrow(0, group.grads_offset, p.numel())
            view.copy_(p.grad.reshape(-1))
            p.grad = view.view_as(p)
            group.grads_offset += p.numel()

    def unscale_grads(self, optimizer):
        """For the verification only: every parameter's whole averaged gradient, gathered from the ranks'
        partitions (a rank keeps only its partition's)."""
        for g in self.groups:
            whole = torch.zeros(g.flat.numel(), dtype=torch.float32, device=g.flat.device)
            if g.host_grad is not None:
                whole[g.start:g.start + g.partition_numel] = g.host_grad.to(whole.device)
            for p, offset in g.in_partition if g.host_grad is None else ():
                lo, hi = max(offset, g.start), min(offset + p.numel(), g.start + g.partition_numel)
                whole[lo:hi] = p.grad.reshape(-1)[lo - offset:hi - offset].float()
            dist.all_reduce(whole)
            for p, offset in zip(g.params, g.offsets):
                p.grad = whole.narrow(0, offset, p.numel()).view_as(p).to(p.dtype)
        self.whole_grads = True

    def optimizer_step(self, optimizer):
        for g in self.groups:
            if g.host_grad is not None:
                for p in g.params:
                    p.grad = None
                g.master.grad = g.host_grad
                continue
            flat = torch.zeros(g.partition_numel, dtype=g.flat.dtype, device=g.flat.device)  # get_flat_partition
            end = g.start + g.partition_numel
            for p, offset in g.in_partition:
                lo, hi = max(offset, g.start), min(offset + p.numel(), end)
                flat[lo - g.start:hi - g.start] = p.grad.reshape(-1)[lo - offset:hi - offset]
            for p in g.params:
                p.grad = None  # free_grad_in_param_list
            g.grads = None
            g.master.grad = flat.to(device=g.master.device, dtype=torch.float32)
            del flat
        optimizer.step()
        if self.offload_optimizer:
            self._count_host_bytes()
        for g in self.groups:
            g.master.grad = g.host_grad  # the host buffer stays (offload), the converted copy goes
            g.partition.copy_(g.master.detach())
            _collective(ALL_GATHER, g.flat, g.partition)  # in place, as all_gather_dp_groups
        self.whole_grads = False


def element_count(value: float) -> int:
    """A DeepSpeed size in elements (its JSON allows 5e8) as an int."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise UsageError(f"{value!r} is not a number of elements")
    return int(value)
