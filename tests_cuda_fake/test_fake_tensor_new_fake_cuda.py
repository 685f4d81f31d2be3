"""`new_fake_tensor` on fake CUDA tensors: the tensor torch's FakeTensor constructor makes (tests/test_fake_tensor_new.py
compares them), and a device torch names otherwise (`cuda`, which it names `cuda:0`) left to torch's constructor."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from bench.measure.fake_tensor_new import new_fake_tensor
from tests.test_fake_tensor_new import assert_the_same_as_torchs
from tests_cuda_fake.conftest import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("unsafe", [False, True])
def test_the_same_cuda_tensor_as_torchs_constructor(requires_grad, unsafe):
    assert_the_same_as_torchs("cuda:0", requires_grad, unsafe)


def test_a_device_torch_would_name_otherwise_takes_torchs_constructor():
    made = new_fake_tensor(FakeTensorMode(allow_non_fake_inputs=True), torch.empty(2, device="meta"),
                           torch.device("cuda"))
    assert made.fake_device == torch.device("cuda:0")
