"""The fake-CUDA mode: membench's CUDA code path on fake tensors, in the fake-CUDA environment (`measure.fake_cuda`).

The stub libraries of that environment (bench.measure.cuda_stubs) make torch see one CUDA device; `fake_cuda()`
makes the tensors fake, so that no kernel runs and nothing is allocated, while CUDA's own operators decide what each
step creates (CUDA's autocast lists, cuDNN's batch norm, the fused optimizers). Used by the fake-CUDA tests and by
`predict`'s `fake-cuda` engine. What it changes in torch, and why, all undone on exit:
- `FakeCudaMode.avoid_device_init` is forced on: torch derives it from `torch.cuda.is_available()` (True here),
  and without it `torch.tensor(0.0, device="cuda")` (BatchNorm's counter, GradScaler's scale) would be made real,
  calling the stubs' cudaMalloc.
- `torch.tensor(data, device="cuda")` is made on the CPU and lifted (FakeTensorMode's `only_lift_cpu_tensors`) on
  every thread an operator of the mode runs on, autograd's backward thread included: the flag is thread-local and
  FakeTensorMode sets it on the entering thread only, so a tensor made from data in backward (an optimizer step in a
  post-accumulate-grad hook creating torchao's 8-bit quantisation map) called the stubs. The backward thread keeps
  the flag after the mode ends (it is the fake-CUDA process's thread, and makes no tensor from data outside it).
- fake tensors made from an operator's meta result are not memoised: the memo holds a weak reference to each, and
  `nn.Module.to()` must swap a fake parameter for its moved copy, which `torch.utils.swap_tensors` refuses for a
  tensor with a weak reference. (FakeTensorMode's dispatch cache stays on: it keeps output metadata, not the
  tensors, and every case of the fake-CUDA run passes with it, in two thirds of the time.)
- values: a number read from a fake tensor is a placeholder (`FakeCudaMode`), and GradScaler takes every
  step (`counted_grad_scaler`, which also counts its calls).
- `FakeAllocator` (bench.measure.fake_allocator) counts the live bytes of fake CUDA tensors, answers torch.cuda's
  allocator statistics from that count, and raises CUDA's out-of-memory error past the process's memory fraction
  (which `--memory-limit` sets).
- page-locked host memory (`FakeCudaMode`) and the optimizers' `foreach` implementations
  (`foreach_on_fake_tensors`) for fake tensors.
- the objects that exist on entry are left alone by Python's collector while inside (`heap_frozen`);
- CUDA is initialised on entry (`torch.cuda.init()`), so that a checkpointed forward is never where it starts;
- a `DeviceMesh` (FSDP2's) is built outside the fake mode (`device_meshes_outside_fake_mode`): its table of ranks
  is host bookkeeping that it searches with `nonzero`, which a fake tensor cannot answer.
`MEMBENCH_PLUGINS=bench.measure.fake_cuda_mode` with MEMBENCH_FAKE_CUDA_WORKER=1
(`bench.measure.fake_cuda.worker_environment`) makes an isolated worker (`python -m bench.run._worker`) run its case
under the same mode: importing this module there enters it for the process's life.
"""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, _BypassDispatchCache, in_kernel_invocation_manager

from bench.core.collector import frozen_after
from bench.measure.fake_cuda import WORKER_FLAG
from bench.measure.fake_allocator import FakeAllocator
from bench.measure.fake_tensor_new import new_fake_tensor


_PLACEHOLDER_OPS = frozenset(map(id, (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default,
                                       torch.ops.aten.allclose.default)))
_PINNED_OPS = frozenset(map(id, (torch.ops.aten._pin_memory.default, torch.ops.aten.is_pinned.default)))
_UNSAFE_VIEW, _VIEW = torch.ops.aten._unsafe_view.default, torch.ops.aten.view.default


class FakeCudaMode(FakeTensorMode):
    """FakeTensorMode for CUDA tensors on a machine whose CUDA libraries are stubs (see the module docstring), which
    also answers what a fake tensor cannot:
    - values: a number read from a tensor (`.item()`, `float(t)`) is 1, a truth value (`bool(t)`) False, and
      `torch.equal`/`allclose` say True, so that the code that reads values (the verification against the baseline,
      a DataLoader's seed, Adam's step count, which divides by `1 - beta ** step`) runs its usual path; what it
      computes from them means nothing. GradScaler's "an infinite gradient was found" would read 1 here:
      `counted_grad_scaler` takes the step regardless.
    - page-locked host memory, which FakeTensorMode does not implement (`aten._pin_memory`): a pinned copy is a fake
      host tensor like the original, and a tensor it returned is pinned.
    Here, not as dispatch modes of their own: each mode on the stack is a Python call in every operator of a step
    (with the tracker's pytree walk, those two modes were a quarter of a full-size prediction's time:
    docs/prediction.md)."""

    avoid_device_init = True  # a property of FakeTensorMode: False wherever torch.cuda.is_available()

    def __init__(self):
        """A FakeTensorMode whose fake tensors carry no weak reference."""
        super().__init__(allow_non_fake_inputs=True)
        self.pinned: set[int] = set()

        def from_meta_and_device(fake_mode, meta, device, pytype=None, dispatch_keys=None):
            """FakeTensorConverter.from_meta_and_device without the weak memo (the meta tensor is fresh anyway)."""
            if pytype is not None or dispatch_keys is not None:
                return FakeTensor(fake_mode, meta, device, pytype=pytype, dispatch_keys=dispatch_keys)
            return new_fake_tensor(fake_mode, meta, device)

        self.fake_tensor_converter.from_meta_and_device = from_meta_and_device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """FakeTensorMode's dispatch, after setting `only_lift_cpu_tensors` on this thread (see the module's
        docstring: autograd's thread never entered the mode); placeholder values and pinned memory answered here."""
        if not torch._C._only_lift_cpu_tensors():
            torch._C._set_only_lift_cpu_tensors(True)
        if id(func) in _PLACEHOLDER_OPS:  # by id, as these sets hold them: an OpOverload hashes in Python
            if func is torch.ops.aten._local_scalar_dense.default:
                tensor = args[0]
                return False if tensor.dtype == torch.bool else 1.0 if tensor.is_floating_point() else 1
            return True
        if id(func) in _PINNED_OPS:
            if func is torch.ops.aten.is_pinned.default:
                return id(args[0]) in self.pinned
            copy = super().__torch_dispatch__(torch.ops.aten.clone.default, types, (args[0],), {})
            self.pinned.add(id(copy))
            return copy
        if func is _UNSAFE_VIEW and self.shape_env is None and type(args[0]) is FakeTensor and args[0].constant is None:
            # torch's dispatch cache never holds `_unsafe_view` (its schema promises a new tensor; it returns its
            # input's storage), and each one took the uncached way: a tenth of a QLoRA prediction's operators, after
            # every matmul of a 3-d input. ATen makes it as `view` (both are its view_impl), whose result the cache
            # makes as a view of the same storage: the same tensor, above this mode still `_unsafe_view`'s result
            try:
                return self.dispatch(_VIEW, types, args, kwargs)
            except (RuntimeError, ValueError):  # not viewable: `_unsafe_view` raises it in its own words
                pass
        # FakeTensorMode's dispatch itself: its __torch_dispatch__ around it only counts the call for torch's
        # statistics and disables dynamo a second time (this method already runs with it disabled)
        return self.dispatch(func, types, args, kwargs)

    def _prep_args_for_hash(self, result: list, args, state, id_hashed_objects: list) -> None:
        """FakeTensorMode's dispatch-cache key for an operator's arguments, made in a quarter of the time (its own cost
        a third of each cached operator's): each fake tensor as one tuple of what torch's `TensorMetadata` holds, less
        the memory format (a function of shape and strides), Python values as their type and value, lists and tuples
        as their type and length. Anything else (a mode with a shape environment, dicts, sparse tensors, symbolic
        values, functions) takes torch's own way, item by item: the cache's hits and bypasses are torch's, and so is
        every output it gives."""
        if self.shape_env is not None or isinstance(args, dict):
            super()._prep_args_for_hash(result, args, state, id_hashed_objects)
            return
        if isinstance(args, (list, tuple)):
            result.append(type(args))
            result.append(len(args))  # an int where torch writes "length_<n>": no key of one way equals the other's
        for arg in args:
            cls = type(arg)
            if cls is FakeTensor and arg.layout is torch.strided:
                if arg.fake_mode is not self:
                    raise _BypassDispatchCache("not our fake")
                if arg.constant is not None:
                    raise _BypassDispatchCache("constant attribute")
                result.append((arg.dtype, arg.shape, arg.stride(), arg.device, arg.storage_offset(),
                               arg.untyped_storage().nbytes(), arg.requires_grad, arg.is_quantized, arg.is_conj(),
                               arg.is_neg(), arg.is_inference()))
            elif cls in _PLAIN_ARGUMENT_TYPES:
                result.append(cls)
                result.append(arg)
            elif cls is list or cls is tuple:
                self._prep_args_for_hash(result, arg, state, id_hashed_objects)
            else:
                super()._prep_args_for_hash(result, (arg,), state, id_hashed_objects)

    def _get_output_tensor_from_cache_entry(self, state, entry, key, func, args):
        """FakeTensorMode's output made from a cache entry, in two thirds of the time for a new tensor: without a
        shape environment the entry's sizes are plain numbers (torch resolves each through a generator), and a
        view's storage is set in the same kernel-invocation context the empty tensor is made in (torch enters it
        twice). In-place results, constants and a mode with a shape environment take torch's way."""
        metadata = entry.metadata
        if self.shape_env is not None or metadata is None or entry.inplace_idx is not None:
            return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        # a view's storage is its input's (the cache keeps which input)
        storage = (args[entry.view_idx].untyped_storage()
                   if isinstance(func, torch._ops.OpOverload) and func.is_view else None)
        with in_kernel_invocation_manager(self):
            empty = torch.empty_strided(metadata.shape, metadata.stride, dtype=metadata.dtype, layout=metadata.layout,
                                        device="meta", requires_grad=metadata.requires_grad)
            if metadata.is_conj:
                torch._C._set_conj(empty, True)
            if metadata.is_neg:
                torch._C._set_neg(empty, True)
            if storage is not None:
                empty.set_(storage, metadata.storage_offset, metadata.shape, metadata.stride)
        return new_fake_tensor(self, empty, metadata.device)


# arguments that FakeTensorMode's cache key holds as their type and value (its last case)
_PLAIN_ARGUMENT_TYPES = frozenset({int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout,
                                   torch.memory_format})


@dataclass
class ScalerCalls:
    """What GradScaler did: losses scaled, optimizers unscaled, steps taken."""

    scaled: int = 0
    unscaled: int = 0
    steps: int = 0


@contextlib.contextmanager
def counted_grad_scaler() -> Iterator[ScalerCalls]:
    """GradScaler's scale, unscale_ and step counted, and every step taken: whether it skips one (an infinite
    gradient found, `found_inf.item()`) is data, which fake tensors do not have."""
    scaler = torch.amp.GradScaler
    saved = scaler.scale, scaler.unscale_, scaler._maybe_opt_step
    calls = ScalerCalls()

    def scale(self, outputs):
        calls.scaled += 1
        return saved[0](self, outputs)

    def unscale_(self, optimizer):
        calls.unscaled += 1
        return saved[1](self, optimizer)

    def maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        calls.steps += 1
        return optimizer.step(*args, **kwargs)

    scaler.scale, scaler.unscale_, scaler._maybe_opt_step = scale, unscale_, maybe_opt_step
    try:
        yield calls
    finally:
        scaler.scale, scaler.unscale_, scaler._maybe_opt_step = saved


@contextlib.contextmanager
def foreach_on_fake_tensors() -> Iterator[None]:
    """Optimizers and gradient utilities take their `foreach` implementation only for tensors whose type is exactly
    Tensor or Parameter: a FakeTensor is added to those lists, so that a fake step uses the implementation a real
    GPU step uses (Adam's default on CUDA is foreach; it would fall back to the per-parameter loop)."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    lists = (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types)
    for types in lists:
        types.append(FakeTensor)
    try:
        yield
    finally:
        for types in lists:
            types.remove(FakeTensor)


@contextlib.contextmanager
def device_meshes_outside_fake_mode() -> Iterator[None]:
    """`DeviceMesh(device_type, ranks)` built with the fake mode set aside, as PyTorch's own tracing builds a
    sub-mesh (device_mesh.py, `unset_fake_temporarily`): the mesh's rank table is a real host tensor, as on a GPU.
    (`init_device_mesh` makes its table before the constructor runs, so it still cannot run under the mode.)"""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    constructor = DeviceMesh.__init__

    def built_outside(self, *args, **kwargs):
        with unset_fake_temporarily():
            constructor(self, *args, **kwargs)

    DeviceMesh.__init__ = built_outside
    try:
        yield
    finally:
        DeviceMesh.__init__ = constructor


_FROZEN_DEPTH = [0]  # heap_frozen() contexts entered now


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """Python's collector leaves the objects that exist on entry alone while inside (`gc.freeze`, undone at the
    outermost exit): a full-size fake step makes hundreds of thousands of objects, and each full collection in it
    walked every object the imports had made (torch, transformers), 0.5 s of the 3.9 s of CPU of llama-3.1-8b's
    three traced steps. What the step makes is collected as before, at other moments (the collector's counts restart
    on entry), as any change in the objects a step makes moves them; llama-3.1-8b's event log (lora+checkpoint, whose
    warm-up cycles `bench.run.passes.collect_warmup_garbage` collects) was the same with and without."""
    if _FROZEN_DEPTH[0] == 0:
        gc.freeze()
    _FROZEN_DEPTH[0] += 1
    try:
        yield
    finally:
        _FROZEN_DEPTH[0] -= 1
        if _FROZEN_DEPTH[0] == 0:
            gc.unfreeze()


_TENSOR_CACHES: list[Callable[[], None]] = []


def clear_on_fake_mode_change(cache_clear: Callable[[], None]) -> None:
    """Registers a cache of tensors (its `cache_clear`) to be emptied when a fake-CUDA mode starts and ends: inside,
    its tensors are fake tensors of that mode, which none may outlive. The layers above register theirs."""
    _TENSOR_CACHES.append(cache_clear)


def _clear_tensor_caches() -> None:
    for cache_clear in _TENSOR_CACHES:
        cache_clear()


def is_fake_device() -> bool:
    """Whether this process's CUDA device is the stubs' fake one (the fake-CUDA environment), not a GPU."""
    return torch.cuda.is_available() and "fake" in torch.cuda.get_device_name(0)


@contextlib.contextmanager
def fake_cuda(allocator: FakeAllocator | None = None, inner: Iterable[ContextManager] = ()) -> Iterator[ScalerCalls]:
    """Everything inside runs on fake CUDA tensors; yields GradScaler's calls. `allocator` (default: one with no
    limit but the memory fraction) counts the fake CUDA bytes and answers torch.cuda's memory statistics; `inner`
    are entered last, inside all of that (a dispatch mode that should see what reaches the fake tensors)."""
    _clear_tensor_caches()  # cached tensors are fake tensors of one mode: none may outlive it
    with frozen_after():  # FakeTensorMode's first construction imports torch._dynamo: 0.5 s, its objects frozen after
        import torch._dynamo  # noqa: F401
    # CUDA initialised now, as a GPU step's earlier work would have: torch.utils.checkpoint refuses a device state
    # first initialised in a checkpointed forward (a first case that checkpoints would fail otherwise)
    torch.cuda.init()
    allocator = allocator or FakeAllocator()
    try:
        with contextlib.ExitStack() as stack:
            calls = stack.enter_context(counted_grad_scaler())
            stack.enter_context(heap_frozen())
            stack.enter_context(foreach_on_fake_tensors())
            stack.enter_context(device_meshes_outside_fake_mode())
            stack.enter_context(FakeCudaMode())
            stack.enter_context(allocator)
            stack.enter_context(allocator.answering_memory_queries())
            for context in inner:
                stack.enter_context(context)
            yield calls
    finally:
        _clear_tensor_caches()


# an isolated worker of the fake-CUDA environment, which imports this as a plugin; in a torch built without CUDA the
# variable can only have been set by hand, and is refused by the CLI (bench.core.job_environment) rather than failing
# every import of this module (`import membench` included) with torch's assertion
if os.environ.get(WORKER_FLAG) == "1" and torch.version.cuda is not None:
    _worker_context = fake_cuda()
    _worker_context.__enter__()
