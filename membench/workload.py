"""A workload made from the user's own callables (model builder, batch, loss, optimizer factory) for membench's API.

`workload_from_callables(...)` makes one, so that everything the command line does (predict, fit, plan, compare, report) runs on a model defined in a script or a
notebook: `workload_from_callables(...)`, the engine of `membench`'s Python API.

A workload made here is registered in this process under the spec `membench.workload:NAME` (the loader's
`package.module:NAME` form), which any code of this process resolves; another process (the fake-CUDA
environment's, a worker of `--isolate`) resolves it only through `importable_as`, a `path/file.py:FUNCTION` spec
whose function returns the same workload.
"""

from __future__ import annotations

import argparse
import logging
import math
import operator
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map

from bench.core.errors import UsageError
from bench.run import case as case_module
from bench.run.isolation import process_state
from workloads.framework.base import Workload, forget_cached

SPEC_PREFIX = "membench.workload"


class InputError(UsageError, ValueError):
    """One of the user's inputs to membench (the batch, the loss, the optimizer, the model builder, any argument)
    is not usable; the message names the input and says why, in one line. A ValueError, as Python's own functions
    raise for a bad value."""


def parsed(name: str, parse: Callable[..., Any], *args: Any) -> Any:
    """`parse(*args)` -- the command line's own parser of the value, so that the API takes each value as the command
    line does (one type, one meaning) -- with its error (a UsageError, or argparse's) raised as an InputError that
    names the argument `name`."""
    try:
        return parse(*args)
    except InputError:
        raise
    except (UsageError, argparse.ArgumentTypeError) as error:
        text = str(error)
        raise InputError(text if text.startswith(name) else f"{name}: {text}") from None


@dataclass(frozen=True)
class Shape:
    """A tensor given by its shape and dtype only (no memory), for a batch too large to hold: made as zeros of that
    shape wherever a real batch is needed (zeros are valid token ids and class labels).

    Example: `batch=(Shape(8, 1024, dtype=torch.long), Shape(8, 1024, dtype=torch.long))`."""

    dims: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def __init__(self, *dims: int, dtype: torch.dtype = torch.float32):
        if not isinstance(dtype, torch.dtype):
            raise InputError(f"Shape: dtype {dtype!r} is not a torch.dtype (e.g. torch.long)")
        checked = []
        for dim in dims:
            try:
                size = operator.index(dim)  # 2.5 is no size: int() would cut it to 2 without a word
            except TypeError:
                raise InputError(f"Shape{dims!r}: {dim!r} is not a whole number of elements") from None
            if size < 0:
                raise InputError(f"Shape{dims!r}: {size} is negative; a dimension holds 0 or more elements")
            checked.append(size)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if math.prod(checked) * itemsize >= 2**63:  # torch's storage size is a signed 64-bit count of bytes
            raise InputError(f"Shape{dims!r}: {math.prod(checked):,} elements of {dtype} are more bytes than a "
                             "tensor can hold (2**63)")
        object.__setattr__(self, "dims", tuple(checked))
        object.__setattr__(self, "dtype", dtype)

    def zeros(self, batch_size: int | None = None) -> torch.Tensor:
        """The tensor as zeros, with `batch_size` rows in place of the first dimension when given."""
        dims = self.dims if batch_size is None or not self.dims else (batch_size, *self.dims[1:])
        return torch.zeros(dims, dtype=self.dtype)


def _leaves(value: Any) -> list:
    found: list = []
    tree_map(lambda leaf: found.append(leaf) if isinstance(leaf, (torch.Tensor, Shape)) else None, value)
    return found


def batch_rows(batch: Any) -> int:
    """The batch size of a (nested) batch: the first dimension of its first tensor; an InputError without one."""
    leaves = [leaf for leaf in _leaves(batch) if (leaf.dim() if isinstance(leaf, torch.Tensor) else len(leaf.dims))]
    if not leaves:
        raise InputError("batch: holds no tensor with a batch dimension; give (inputs, target) with tensors (or "
                         "membench.Shape) whose first dimension is the batch")
    first = leaves[0]
    return int(first.shape[0] if isinstance(first, torch.Tensor) else first.dims[0])


def resized_batch(batch: Any, rows: int, size: int) -> Any:
    """`batch` (of `rows` rows) with `size` rows: each tensor's first dimension cut or tiled (memory does not depend
    on the values), each Shape made as zeros; a tensor without that batch dimension is kept whole."""
    def resize(leaf: Any) -> Any:
        if isinstance(leaf, Shape):
            return leaf.zeros(size if leaf.dims and leaf.dims[0] == rows else None)
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or leaf.shape[0] != rows or size == rows:
            return leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf
        repeats = -(-size // rows)
        return leaf.detach().repeat(repeats, *([1] * (leaf.dim() - 1)))[:size].clone()
    return tree_map(resize, batch)


class CallableWorkload(Workload):
    """The base of workloads made by `workload_from_callables`: its callables and batch are class attributes."""

    description = "a workload made from the user's callables (membench's Python API)"
    build_fn: Callable[[], nn.Module]
    example_batch: Any = None  # (inputs, target) of `example_rows` rows, or None when `batch_fn` makes batches
    example_rows: int = 0
    batch_fn: Callable[[int], Any] | None = None
    loss_fn: Callable[[Any, Any], torch.Tensor]
    optimizer_fn: Callable[[Any], torch.optim.Optimizer] | None = None
    units_fn: Callable[[nn.Module], list] | None = None

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        model = type(self).build_fn()
        if not isinstance(model, nn.Module):
            raise InputError(f"model: the build function returned {type(model).__name__}, not a torch.nn.Module")
        return model

    def make_batch(self, batch_size: int, data: str = "synthetic") -> tuple[Any, torch.Tensor]:
        self.check_data(data)
        cls = type(self)
        if cls.batch_fn is not None:
            made = cls.batch_fn(batch_size)
        else:
            made = resized_batch(cls.example_batch, cls.example_rows, batch_size)
        if not (isinstance(made, (tuple, list)) and len(made) == 2):
            raise InputError(f"batch: expected (inputs, target), got {type(made).__name__}")
        return tuple(made)

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return type(self).loss_fn(output, target)

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        factory = type(self).optimizer_fn
        return torch.optim.Adam(model.parameters()) if factory is None else factory(model.parameters())

    def checkpoint_units(self, model: nn.Module) -> list[nn.Module]:
        units = type(self).units_fn
        return list(units(model)) if units is not None else super().checkpoint_units(model)


def workload_from_callables(model: Callable[[], nn.Module] | nn.Module, batch: Any = None,
                            loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                            optimizer: Callable[[Any], torch.optim.Optimizer] | None = None, *,
                            name: str = "my_model", batch_fn: Callable[[int], Any] | None = None,
                            checkpoint_units: Callable[[nn.Module], list] | None = None,
                            importable_as: str | None = None, seed: int = 0) -> CallableWorkload:
    """A Workload from the user's callables, registered in this process as `membench.workload:NAME`.

    `model`: a function that builds the model (preferred: it can then be built on fake tensors at full size) or a
    built model (copied for each pass); `batch`: `(inputs, target)` of tensors or `Shape`s (inputs a tensor, a
    tuple of positional arguments or a dict of keyword arguments), tiled or cut to other batch sizes, or
    `batch_fn(batch_size)` making one; `loss_fn(output, target)` a scalar; `optimizer(params)` an optimizer over
    them (default: Adam); `checkpoint_units(model)` the blocks checkpointing may recompute; `importable_as` a
    `path/file.py:FUNCTION` spec whose function returns this same workload, so that other processes (the
    fake-CUDA environment, `--isolate`) resolve it too.

    Example:
        >>> import torch
        >>> w = workload_from_callables(lambda: torch.nn.Linear(4, 2), (torch.ones(3, 4), torch.zeros(3, 2)),
        ...                             torch.nn.functional.mse_loss, name="doc_linear")
        >>> w.spec(), w.default_batch_size
        ('membench.workload:doc_linear', 3)
    """
    if not (isinstance(name, str) and name.isidentifier()):
        raise InputError(f"name: {name!r} is not a Python identifier (letters, digits and _)")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InputError(f"seed: {seed!r} is not a whole number (torch.manual_seed's seed)")
    module = sys.modules[__name__]
    existing = getattr(module, name, None)
    if existing is not None and not (isinstance(existing, type) and issubclass(existing, CallableWorkload)):
        raise InputError(f"name: {name!r} is taken by membench.workload itself; choose another")
    if loss_fn is None or not callable(loss_fn):
        raise InputError("loss_fn: give a function loss_fn(output, target) that returns a scalar tensor")
    if optimizer is not None and not callable(optimizer):
        raise InputError(f"optimizer: {type(optimizer).__name__} is not callable; give a factory such as "
                         "`lambda params: torch.optim.AdamW(params, lr=1e-3)`")
    if isinstance(model, nn.Module):
        built = model
        build_fn = lambda: _copy_module(built)  # noqa: E731 - each pass gets a fresh copy, as a builder would make
    elif callable(model):
        build_fn = model
    else:
        raise InputError(f"model: {type(model).__name__} is neither a torch.nn.Module nor a function building one")
    if batch is None and batch_fn is None:
        raise InputError("batch: give one batch (inputs, target), or batch_fn(batch_size)")
    if batch is not None and not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise InputError(f"batch: expected (inputs, target), got {type(batch).__name__}"
                         + (f" of {len(batch)} items" if isinstance(batch, (tuple, list)) else ""))
    rows = batch_rows(batch) if batch is not None else 8
    importable_as = _reference_elsewhere(importable_as)
    attributes = {
        "name": name, "build_fn": staticmethod(build_fn), "example_batch": batch, "example_rows": rows,
        "batch_fn": staticmethod(batch_fn) if batch_fn is not None else None,
        "loss_fn": staticmethod(loss_fn), "optimizer_fn": staticmethod(optimizer) if optimizer else None,
        "units_fn": staticmethod(checkpoint_units) if checkpoint_units else None,
        "default_batch_size": rows, "seed": seed, "importable_as": importable_as, "__module__": __name__,
    }
    cls = type(name, (CallableWorkload,), attributes)
    if existing is not None:
        _forget(f"{SPEC_PREFIX}:{name}")
    setattr(module, name, cls)
    workload = cls()
    workload.reference = importable_as or f"{SPEC_PREFIX}:{name}"
    return workload


def _reference_elsewhere(importable_as: str | None) -> str | None:
    """`importable_as` as another process resolves it wherever it starts: a `path/file.py:FUNCTION` spec with the
    path made absolute (relative, it names a file only from the folder this script was started in); an InputError
    saying what to give where the file is not there, or the spec is not of the loader's forms."""
    if importable_as is None:
        return None
    head, colon, rest = str(importable_as).partition(":")
    if not (isinstance(importable_as, str) and colon and head and rest):
        raise InputError(f"importable_as: {importable_as!r} is not `path/file.py:FUNCTION` (nor "
                         "`package.module:FUNCTION`); in a script, importable_as=f\"{__file__}:FUNCTION\"")
    if not head.lower().endswith(".py"):
        return importable_as  # a module: found through sys.path by any process that has this one's
    path = Path(head).expanduser()
    if not path.is_file():
        raise InputError(f"importable_as: no file {head!r} here (a relative path is read from the working folder, "
                         f"{os.getcwd()}); give the script's own path, importable_as=f\"{{__file__}}:"
                         f"{rest.split(':')[0]}\", which names it from any folder")
    return f"{path.resolve()}:{rest}"


def _copy_module(model: nn.Module) -> nn.Module:
    import copy
    return copy.deepcopy(model)


def _forget(spec: str) -> None:
    """Drops what this process cached for a workload spec now redefined (a notebook cell run again)."""
    case_module.cpu_batch.cache_clear()
    case_module.full_workload_spec.cache_clear()
    forget_cached(spec)


def check_inputs(workload: Workload, batch_size: int | None = None) -> None:
    """An InputError naming the input when the model rejects the batch, the loss is not a scalar, or the optimizer
    holds parameters that are not the model's; checked on fake tensors (nothing full-size is allocated). A model
    or step that fake tensors cannot run is not checked here (its own error comes from the step).

    Example:
        >>> import torch
        >>> w = workload_from_callables(lambda: torch.nn.Linear(4, 2), (torch.ones(3, 5), torch.zeros(3, 2)),
        ...                             torch.nn.functional.mse_loss, name="doc_bad_batch")
        >>> check_inputs(w)
        Traceback (most recent call last):
        ...
        membench.workload.InputError: batch: the model rejects it: RuntimeError: a and b must have same reduction dim, but got [3, 5] X [4, 2].
    """
    logger = logging.getLogger("torch._subclasses.fake_tensor")  # it logs each rejected operator's traceback
    level, logger.disabled = logger.disabled, True
    try:
        with process_state():  # the user's builder may set torch's default dtype and leave it for the next model
            _check_on_fake_tensors(workload, batch_size)
    finally:
        logger.disabled = level


def _check_on_fake_tensors(workload: Workload, batch_size: int | None) -> None:
    from torch._subclasses import fake_tensor

    fake_limits = tuple(getattr(fake_tensor, name) for name in (
        "DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException",
        "UnsupportedFakeTensorException") if hasattr(fake_tensor, name))
    size = batch_size or workload.default_batch_size
    inputs, target = workload.make_batch(size, workload.data_sources[0])
    with torch.random.fork_rng(devices=[]), fake_tensor.FakeTensorMode(allow_non_fake_inputs=True) as mode:
        try:
            model = workload.build_model()
        except InputError:
            raise
        except fake_limits:
            return
        except Exception as error:  # noqa: BLE001 - the user's builder failed: named in one line
            raise InputError(f"model: the build function failed: {_one_line(error)}") from None
        fake_inputs, fake_target = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t,
                                            (inputs, target))
        model.train()
        try:
            output = workload.run_model(model, fake_inputs)
        except fake_limits:
            return
        except Exception as error:  # noqa: BLE001
            raise InputError(f"batch: the model rejects it: {_one_line(error)}") from None
        try:
            loss = workload.loss(_float32(output), fake_target)
        except fake_limits:
            return
        except Exception as error:  # noqa: BLE001
            raise InputError(f"loss_fn: failed on the model's output and the target: {_one_line(error)}") from None
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise InputError(f"loss_fn: returned {shape}, not a scalar tensor (reduce it, e.g. .mean())")
        if not loss.requires_grad:
            raise InputError("loss_fn: its result does not depend on the model's parameters (no gradient)")
        try:
            optimizer = workload.make_optimizer(model)
        except Exception as error:  # noqa: BLE001
            raise InputError(f"optimizer: the factory failed on the model's parameters: {_one_line(error)}") from None
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InputError(f"optimizer: the factory returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
        check_optimizer(optimizer, model)


def check_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """An InputError when `optimizer` updates tensors that are not parameters of `model`."""
    own = {id(p) for p in model.parameters()}
    foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in own]
    if foreign:
        raise InputError(f"optimizer: {len(foreign)} of its parameters are not the model's (built over another "
                         "model? give a factory, e.g. `lambda params: torch.optim.AdamW(params)`)")


def _float32(output: Any) -> Any:
    return tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, output)


def _one_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    return text[0][:300] if text else type(error).__name__
