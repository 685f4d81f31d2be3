"""`new_fake_tensor` (bench.measure.fake_tensor_new) makes the tensor torch's FakeTensor constructor makes: the same
subclass, device, dispatch keys, flags and attributes, whatever the meta tensor's grad and the mode's data-pointer
rule (fake CUDA tensors: tests_cuda_fake/test_fake_tensor_new_fake_cuda.py, with these functions)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from bench.measure.fake_tensor_new import new_fake_tensor


def state(tensor: FakeTensor) -> dict:
    return {"type": type(tensor), "dict": dict(tensor.__dict__), "keys": torch._C._dispatch_keys(tensor),
            "requires_grad": tensor.requires_grad, "shape": tensor.shape, "stride": tensor.stride(),
            "dtype": tensor.dtype, "fake_device": tensor.fake_device, "device": tensor.device}


def assert_the_same_as_torchs(device: str, requires_grad: bool, unsafe: bool) -> None:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    mode._allow_unsafe_data_ptr_access = unsafe

    def meta():
        return torch.empty_strided((4, 3), (1, 4), dtype=torch.bfloat16, device="meta", requires_grad=requires_grad)

    ours, torchs = new_fake_tensor(mode, meta(), torch.device(device)), FakeTensor(mode, meta(), torch.device(device))
    assert state(ours) == state(torchs)
    with mode:  # it computes as torch's does
        assert state(ours * 2) == state(torchs * 2)


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("unsafe", [False, True])
def test_the_same_tensor_as_torchs_constructor(requires_grad, unsafe):
    assert_the_same_as_torchs("cpu", requires_grad, unsafe)
