"""The mechanism model of DeepSpeed's ZeRO-3 (what its engine allocates per rank, and when), on the base that ZeRO-2
shares (strategies/framework/deepspeed_zero.py, whose docstring says how the model runs and is checked).

ZeRO-3 (stage3.py `DeepSpeedZeroOptimizer_Stage3`, partition_parameters.py, parameter_offload.py):
- each parameter partitioned on its own: ceil(numel / N) elements per rank (`ds_tensor`), the partitions of all
  parameters one flat buffer (`lp_param_buffer`); the parameter's own data is freed (a 0-element tensor) unless it
  has at most `param_persistence_threshold` elements (`ds_persist`: kept whole on every rank);
- the float32 master of each sub-group of `sub_group_size` elements (`fp32_partitioned_groups_flat`), and with
  `offload_optimizer=cpu` one float32 gradient buffer per sub-group on the host (`subgroup_gradient_buffer`);
- one bucket of `reduce_bucket_size` elements, allocated once (`ipg_buckets`; one buffer with `overlap_comm` too),
  and the partitioned gradients of all parameters as one buffer (`grad_partitions_flat_buffer`), kept between steps;
- in the forward and backward, each module's own parameters all-gathered into one buffer just before it runs
  (`fetch_sub_module`, `all_gather_coalesced`) and freed after (`release_sub_module`), persistent ones excepted
  (`PartitionedParameterCoordinator`). The first micro-batch records the order the modules were fetched in, forward
  and backward (its trace, complete from the second forward on); then, at each fetch, the parameters next in the
  trace not yet gathered are gathered ahead (a queue consumed as it goes) up to `stage3_prefetch_bucket_size`
  elements, fewer where `stage3_max_live_parameters` less those gathered allows, and a module's parameter is not
  freed where the trace uses it again within `stage3_max_reuse_distance` elements of the modules after this one
  (`__params_to_release`: at DeepSpeed's default of 1e9, a model of fewer elements keeps each parameter gathered
  from its forward to its backward) or where a prefetch passed over a later use of it;
- `torch.nn.functional.linear` replaced, in the modules' forward, by one that saves the weight parameter itself for
  its backward (`memory_efficient_linear`, default true: `LinearFunctionForZeroStage3`, installed by `zero.Init`,
  which the engine runs on a model built without it); torch's own saves a transposed view of the gathered weight,
  which would keep every gathered weight from its forward to its backward. Under autocast torch's is used;
- each gradient copied into the bucket as it is accumulated, the bucket reduce-scattered when the next would not fit
  (`__reduce_and_partition_ipg_grads`) and each parameter's share added into its partition of the flat gradient
  buffer; in the step, each sub-group in turn: its gradients flattened and converted to float32
  (`_prepare_fp32_grad_for_sub_group`; copied into the host buffer with offload), the optimizer stepped on it, the
  master copied back into the 16-bit partitions and the float32 gradient freed (`_release_sub_group`).
"""

from __future__ import annotations

import collections
import contextlib

import torch
import torch.distributed as dist
from torch import nn

from bench.core.memory_categories import COMMUNICATION, WEIGHTS, allocating
from strategies.framework.deepspeed_zero import (ALL_GATHER, DEFAULT_SUB_GROUP_ELEMENTS, GRADS, OPTIMIZER_STATE,
                                                 REDUCE_SCATTER, DeepSpeedZero, _Bucket, _collective,
                                                 _master_of, _rebuilt_optimizer)
from strategies.framework.sharding import gloo_copy_of_input, rank_and_world


_TORCH_LINEAR = torch.nn.functional.linear


class _LinearSavingWeight(torch.autograd.Function):
    """DeepSpeed's `LinearFunctionForZeroStage3` (runtime/zero/linear.py): the weight saved as the parameter, so that
    its gathered data is freed when the parameter is released, and gathered again for the backward."""

    @staticmethod
    def forward(ctx, input, weight, bias=None):
        ctx.save_for_backward(input, weight, bias)
        if input.dim() == 2 and bias is not None:
            return torch.addmm(bias, input, weight.t())
        output = input.matmul(weight.t())
        if bias is not None:
            output += bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        dim = grad_output.dim()
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(input.reshape(-1, input.shape[-1]))
                           if dim > 2 else grad_output.t().matmul(input) if dim == 2
                           else grad_output.unsqueeze(-1) * input.unsqueeze(0))
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_output.sum(list(range(dim - 1))) if dim > 1 else grad_output
        return grad_input, grad_weight, grad_bias


def _zero3_linear(input, weight, bias=None):
    if torch.is_autocast_enabled(input.device.type):  # DeepSpeed's own autocast handling is not modelled
        return _TORCH_LINEAR(input, weight, bias)
    return _LinearSavingWeight.apply(input, weight, bias)


class _Partitioned:
    """A ZeRO-3 parameter's partition: its slice of the flat buffer, its whole shape, whether it stays whole."""

    def __init__(self, param: nn.Parameter, data: torch.Tensor, persistent: bool):
        self.param = param
        self.shape = param.shape
        self.numel = param.numel()
        self.data = data
        self.persistent = persistent
        self.grad: torch.Tensor | None = None  # its slice of grad_partitions_flat_buffer
        self.users = 0  # modules running now that use it


class Zero3Mechanism(DeepSpeedZero):
    """ZeRO-3's allocations (module docstring): every parameter partitioned, gathered per module as it runs."""

    stage = 3
    options = {**DeepSpeedZero.options, "overlap_comm": True, "prefetch_bucket_size": 50_000_000,
               "max_live_parameters": 1_000_000_000, "max_reuse_distance": 1_000_000_000,
               "param_persistence_threshold": 100_000,
               "sub_group_size": DEFAULT_SUB_GROUP_ELEMENTS, "offload_param": "none"}

    def wrap_optimizer(self, optimizer, model):
        rank, world = rank_and_world()
        self.rank, self.world = rank, world
        self.model = model
        threshold = self.settings["param_persistence_threshold"]
        # the optimizer's groups in order, then the parameters no group holds: the order of DeepSpeed's flat buffer
        grouped = [p for group in optimizer.param_groups for p in group["params"]]
        params = list(dict.fromkeys([*grouped, *model.parameters()]))
        self.by_param: dict[int, _Partitioned] = {}
        dtype, device = params[0].dtype, params[0].device
        part_numels = [-(-p.numel() // world) for p in params]
        param_device = "cpu" if self.settings["offload_param"] == "cpu" else device
        self.lp_buffer = torch.zeros(sum(part_numels), dtype=dtype, device=param_device)  # lp_param_buffer
        offset, starts = 0, {}
        for p, numel in zip(params, part_numels):
            data = self.lp_buffer.narrow(0, offset, numel)
            chunk = p.detach().reshape(-1)[rank * numel:(rank + 1) * numel]
            data[:chunk.numel()].copy_(chunk)
            self.by_param[id(p)] = _Partitioned(p, data, p.numel() <= threshold)
            starts[id(p)] = offset
            offset += numel
        for part in self.by_param.values():
            if not part.persistent:
                part.param.data = part.param.data.new_empty(0)  # the whole parameter freed
        trainable = [self.by_param[id(p)] for p in grouped if p.requires_grad]
        grad_device = "cpu" if self.offload_optimizer else device
        self.grad_buffer = torch.zeros(sum(p.data.numel() for p in trainable), dtype=dtype, device=grad_device)
        offset = 0
        for part in trainable:
            part.grad = self.grad_buffer.narrow(0, offset, part.data.numel())
            offset += part.data.numel()
        masters, per_group, self.lp_groups = [], [], []
        for group in optimizer.param_groups:  # frozen parameters are partitioned, never stepped
            parts = [self.by_param[id(p)] for p in group["params"] if p.requires_grad]
            per_group.append([])
            for sub in self._sub_groups(parts) if parts else []:
                start = starts[id(sub[0].param)]
                self.lp_groups.append(self.lp_buffer.narrow(0, start, sum(p.data.numel() for p in sub)))
                masters.append(_master_of(self.lp_groups[-1], self.offload_optimizer))
                per_group[-1].append(masters[-1])
        # with offload, each sub-group's float32 gradient lives on the host between steps (`subgroup_gradient_buffer`);
        # without, the step makes it anew and frees it (the buffer `initialize_optimizer_states` made is gone after
        # the first step)
        self.fp32_grads = [torch.zeros(m.numel(), dtype=torch.float32, device="cpu") for m in masters
                           ] if self.offload_optimizer else []
        self.masters = masters
        self.bucket = _Bucket(self.settings["reduce_bucket_size"], dtype, device, 1)  # one, overlap_comm or not
        self.whole = False
        self.trace: list[nn.Module] | None = None  # the modules fetched in the first micro-batch, in order
        self.recording: list[nn.Module] = []
        self.step_id = 0  # fetches so far in this micro-batch: the position in the trace
        self.depth = 0
        self.queue: collections.deque = collections.deque()  # (part, the step it is used at) not yet passed
        self.fetched_for: dict[int, int] = {}  # a part's latest use a fetch or prefetch passed over
        model.register_forward_pre_hook(self._reset_step)
        for module in model.modules():
            # every module's forward is fetched, as DeepSpeed hooks every module: each fetch may prefetch
            module.register_forward_pre_hook(lambda m, args: self._enter(m))
            module.register_forward_hook(lambda m, args, output: self._leave(m))
            if any(True for _ in module.parameters(recurse=False)):  # a container's outputs may be no tensors
                module.register_full_backward_pre_hook(lambda m, grad_output: self._fetch(m))
                module.register_full_backward_hook(lambda m, grad_input, grad_output: self._after(m, frozen_only=True))
        for part in trainable:
            part.param.register_post_accumulate_grad_hook(self._gradient_ready)
        model.register_forward_pre_hook(self._file_state)
        self.optimizer = _rebuilt_optimizer(optimizer, per_group)
        return self.optimizer

    @contextlib.contextmanager
    def session(self):
        """The base's session, torch's `F.linear` back at its end however the steps ended (a forward stopped in a
        module, as a plan candidate over its limit is, left DeepSpeed's to the process's later cases)."""
        with contextlib.ExitStack() as stack:
            stack.callback(setattr, torch.nn.functional, "linear", _TORCH_LINEAR)
            stack.enter_context(super().session())
            yield

    def rank_signature(self, rank, world):
        """Ranks differ only by their share of the batch: each holds ceil(numel / N) of every parameter."""
        return ("samples", self.samples_of_rank(rank, world))

    def _sub_groups(self, parts: list[_Partitioned]) -> list[list[_Partitioned]]:
        limit, subs, size = self.settings["sub_group_size"], [[]], 0
        for part in parts:
            if subs[-1] and size + part.data.numel() > limit:
                subs.append([])
                size = 0
            subs[-1].append(part)
            size += part.data.numel()
        return subs

    def persistent_buffers(self):
        return [([self.lp_buffer], WEIGHTS), ([p.param for p in self.by_param.values() if p.persistent], WEIGHTS),
                (self.masters, OPTIMIZER_STATE), ([self.grad_buffer, *self.fp32_grads], GRADS),
                (self.bucket.buffers, COMMUNICATION)]

    # --- the parameters gathered per module ---

    def _own(self, module: nn.Module) -> list[_Partitioned]:
        return [self.by_param[id(p)] for p in module.parameters(recurse=False) if id(p) in self.by_param]

    def _gather(self, parts: list[_Partitioned]) -> None:
        """The parameters not available now, all-gathered into one buffer (`all_gather_coalesced`)."""
        missing = [p for p in parts if not p.persistent and p.param.data.numel() != p.numel]
        if not missing:
            return
        device = self.bucket.buffers[0].device
        sizes = [p.data.numel() * self.world for p in missing]
        with allocating(WEIGHTS):
            flat = torch.empty(sum(sizes), dtype=self.lp_buffer.dtype, device=device)
        offset = 0
        for part, size in zip(missing, sizes):
            out = flat.narrow(0, offset, size)
            _collective(ALL_GATHER, out, part.data.to(device))
            part.param.data = out.narrow(0, 0, part.numel).view(part.shape)
            offset += size

    def _release(self, parts: list[_Partitioned]) -> None:
        for part in parts:
            if not part.persistent and part.users == 0 and not self.whole and not self._used_again(part):
                part.param.data = part.param.data.new_empty(0)

    def _used_again(self, part: _Partitioned) -> bool:
        """Whether DeepSpeed keeps `part` gathered for a later use (`__params_to_release`): a prefetch passed over a
        later use of it, or the trace uses it within `max_reuse_distance` elements of the modules after this step."""
        if self.trace is None:
            return False
        if self.fetched_for.get(id(part), -1) > self.step_id:
            return True
        traversed, limit = 0, self.settings["max_reuse_distance"]
        for module in self.trace[self.step_id:]:
            if traversed >= limit:
                return False
            for other in self._own(module):
                if other is part:
                    return True
                traversed += other.numel
        return False

    def _live_elements(self) -> int:
        return sum(p.numel for p in self.by_param.values() if not p.persistent and p.param.data.numel())

    def _reset_step(self, model, args) -> None:
        """At each forward's start (`reset_step`): the first micro-batch's order becomes the trace at the second."""
        if self.trace is None and self.recording:
            self.trace, self.recording = self.recording, []
        self.step_id = 0
        self.depth = 0  # modules whose forward is running
        self.fetched_for = {}
        self.queue = collections.deque((part, step) for step, module in enumerate(self.trace or [])
                                       for part in self._own(module))

    def _enter(self, module: nn.Module) -> None:
        """A module's forward begins: DeepSpeed's linear in place while any module runs, its parameters fetched."""
        self.depth += 1
        torch.nn.functional.linear = _zero3_linear
        self._fetch(module)

    def _leave(self, module: nn.Module) -> None:
        self._after(module)
        self.depth = max(0, self.depth - 1)
        if not self.depth:
            torch.nn.functional.linear = _TORCH_LINEAR

    def _fetch(self, module: nn.Module) -> None:
        """The module's parameters gathered and marked in use; with a trace, those next in it gathered ahead
        (`_fetch_sub_module_impl`)."""
        parts = self._own(module)
        self._gather(parts)
        for part in parts:
            part.users += 1
        if self.trace is None:
            self.recording.append(module)
        else:
            self._prefetch(parts)
        self.step_id += 1

    def _prefetch(self, parts: list[_Partitioned]) -> None:
        """The module's own uses taken off the queue, then the queue's next parameters not gathered, up to
        `prefetch_bucket_size` elements or what `max_live_parameters` leaves (the last one may pass it, as
        DeepSpeed's loop checks before it takes one)."""
        not_passed = [p for p in parts if self.fetched_for.get(id(p), -1) < self.step_id]
        for _ in not_passed:
            if not self.queue:
                break
            part, step = self.queue.popleft()
            self.fetched_for[id(part)] = step
        budget = self.settings["prefetch_bucket_size"]
        if not budget:
            return
        limit, chosen, numel = min(self.settings["max_live_parameters"] - self._live_elements(), budget), [], 0
        while self.queue and numel < limit:
            part, step = self.queue.popleft()
            self.fetched_for[id(part)] = max(self.fetched_for.get(id(part), -1), step)
            if not part.persistent and not part.param.data.numel() and part not in chosen:
                chosen.append(part)
                numel += part.numel
        self._gather(chosen)

    def _after(self, module: nn.Module, frozen_only: bool = False) -> None:
        """The module's parameters no longer in use by it; freed where no other module uses them and DeepSpeed
        would not keep them for a later use. In backward (`frozen_only`) a trainable parameter is freed once its
        gradient is accumulated (`_gradient_ready`): a module's backward hook fires when its inputs' gradients
        exist, which may be before its weight's."""
        parts = self._own(module)
        for part in parts:
            part.users = max(0, part.users - 1)
        self._release([p for p in parts if not frozen_only or p.grad is None])

    # --- the gradients reduce-scattered through the bucket ---

    def backward(self, loss):
        torch.nn.functional.linear, self.depth = _TORCH_LINEAR, 0  # a forward that raised may have left it in place
        if not self._own(self.model):  # the model's output's gradient comes first: DeepSpeed fetches the root then
            self._fetch(self.model)
        loss.backward()
        self._reduce()
        self.step_id = len(self.trace or [])  # the trace's end: nothing is used again
        for part in self.by_param.values():
            part.users = 0
        self._release(list(self.by_param.values()))

    def _gradient_ready(self, param: nn.Parameter) -> None:
        if not self.bucket.fits(param) and self.bucket.params:
            self._reduce()
        self.bucket.take(param)
        part = self.by_param[id(param)]
        part.users = 0
        self._release([part])

    def _reduce(self) -> None:
        for param in self.bucket.emptied():
            part = self.by_param[id(param)]
            flat = param.grad.reshape(-1)
            padded = part.data.numel() * self.world
            if padded != flat.numel():
                flat = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
            share = torch.empty(part.data.numel(), dtype=flat.dtype, device=flat.device)
            gloo_copy = gloo_copy_of_input(flat)  # what real gloo allocates for it, in a prediction of gloo ranks
            _collective(REDUCE_SCATTER, share, flat)
            del gloo_copy
            part.grad.add_(share.div_(self.world).to(part.grad.device))
            param.grad = None

    def unscale_grads(self, optimizer):
        """For the verification only: every parameter gathered whole and given its whole averaged gradient."""
        self.whole = True
        for part in self.by_param.values():
            self._gather([part])
            if part.grad is not None:
                whole = torch.empty(part.grad.numel() * self.world, dtype=part.grad.dtype, device=part.grad.device)
                ALL_GATHER(whole, part.grad)
                part.param.grad = whole.narrow(0, 0, part.numel).view(part.shape).to(part.param.dtype)

    def optimizer_step(self, optimizer):
        """Each sub-group (at most `sub_group_size` elements) in turn, as DeepSpeed: its gradients flattened as float32
        (or copied into its host buffer), stepped on alone, its master copied into the 16-bit partitions, freed."""
        offset = 0
        for index, (master, lp) in enumerate(zip(self.masters, self.lp_groups)):
            for other in self.masters:
                other.grad = None
            grads = self.grad_buffer.narrow(0, offset, master.numel())
            offset += master.numel()
            if self.offload_optimizer:
                master.grad = self.fp32_grads[index]
                master.grad.copy_(grads)
            else:  # `self.flatten(averaged_gradients).to(float32)`: a new flat partition, then its float32 copy
                master.grad = torch.cat([grads]).to(torch.float32)
            optimizer.step()
            lp.copy_(master.detach())
            master.grad = None  # `_release_sub_group`
        if self.offload_optimizer or self.settings["offload_param"] == "cpu":
            self._count_host_bytes()
        self.grad_buffer.zero_()
        for part in self.by_param.values():
            if part.persistent or self.whole:  # a whole parameter's data is its gathered partitions
                part.param.grad = None
                _collective(ALL_GATHER, _padded_out(part), part.data)
        self.whole = False


def _padded_out(part: _Partitioned) -> torch.Tensor:
    """Where the ranks' partitions of a whole parameter are gathered: the parameter itself, when its padded size is
    its size, else a padded buffer copied into it (through a view that `set_` rebinds)."""
    world = dist.get_world_size()
    padded = part.data.numel() * world
    flat = part.param.data.reshape(-1)
    if flat.numel() == padded:
        return flat
    out = torch.empty(padded, dtype=flat.dtype, device=flat.device)
    part.param.data = out.narrow(0, 0, part.numel).view(part.shape)
    return out
