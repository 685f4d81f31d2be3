"""Making the fake tensors of a step's operators in a fifth of the time `FakeTensor(mode, meta, device)` takes: the
same tensor (its subclass, dispatch keys, data-pointer guard and every attribute torch sets, checked against torch's
own constructor by tests/test_fake_tensor_new.py), its attributes set in one update of its `__dict__` where torch
validates its arguments and sets each memo through a descriptor. A full-size step makes one for each operator's
output, and torch's constructor was a tenth of a traced step's time."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConfig, FakeTensorMode, SymNumberMemoDescriptor

# what FakeTensor.__new__ sets on a tensor made from a fresh meta tensor: no constant, real tensor, Python type or
# dispatch keys of its own, and every memo (the value, its tensor version and its mode's epoch) empty
_MEMOS = [name for name, value in vars(FakeTensor).items() if isinstance(value, SymNumberMemoDescriptor)]
_FRESH = {"constant": None, "pytype": None, "dispatch_keys": None, "real_tensor": None,
          **{f"_{memo}{part}": None for memo in _MEMOS for part in ("", "_vc", "_epoch")}}


# the devices torch's constructor was given once and left as they were (it would name `cuda` as `cuda:0`, and the
# first time it initialises the device's context, as a CUDA tensor's backward needs)
_NORMALIZED: set[torch.device] = set()

# where a FakeTensor keeps its device: `_fake_device` behind the `fake_device` property that normalises it (torch
# 2.13), the plain attribute `fake_device` before (torch 2.11, which has no `FakeTensor._normalize_fake_device`)
_DEVICE_ATTRIBUTE = "_fake_device" if isinstance(vars(FakeTensor).get("fake_device"), property) else "fake_device"


def new_fake_tensor(mode: FakeTensorMode, meta: torch.Tensor, device: torch.device) -> FakeTensor:
    """`FakeTensor(mode, meta, device)` for a meta tensor `meta`; torch's constructor for a device it would name
    otherwise (`cuda` without its index), and in its debug mode."""
    if device not in _NORMALIZED:
        normalize = getattr(FakeTensor, "_normalize_fake_device", None)
        if normalize is None:  # torch 2.11 names the device in the constructor: its tensor, the first time
            tensor = FakeTensor(mode, meta, device)
            if tensor.fake_device == device:
                _NORMALIZED.add(device)
            return tensor
        if normalize(device) != device:
            return FakeTensor(mode, meta, device)
        _NORMALIZED.add(device)
    if FakeTensorConfig.debug or meta.device.type != "meta":
        return FakeTensor(mode, meta, device)
    tensor = torch.Tensor._make_subclass(FakeTensor, meta, meta.requires_grad, dispatch_device=True,
                                         device_for_backend_keys=device)
    if mode._allow_unsafe_data_ptr_access:
        torch._C._set_warn_deprecated_on_mutable_data_ptr(tensor)
    else:
        torch._C._set_throw_on_mutable_data_ptr(tensor)
    state = tensor.__dict__
    state.update(_FRESH)
    state[_DEVICE_ATTRIBUTE] = device
    state["fake_mode"] = mode
    return tensor
