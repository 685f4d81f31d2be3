"""Context parallelism (`cp:degree=N`, strategies/cp.py) on the CPU: PyTorch's ring attention cannot run there, and the
row says why in PyTorch's own terms, which this file checks against PyTorch itself (the CPU's attention kernel under
a sequence-sharded DTensor raises NotImplementedError). Its prediction on fake CUDA: tests_cuda_fake/test_cp_fake_cuda.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.analysis.predict import predict_case
from bench.core.errors import UsageError
from bench.run.case import Case
from bench.run.ranks import fake_process_group
from strategies import parse_strategy

pytest.importorskip("transformers")

LLAMA = "hf:tiny-llama:seq_len=128"


def test_on_the_cpu_the_row_is_unsupported_and_names_the_kernel_ring_attention_lacks():
    row = predict_case(Case(LLAMA, "fsdp+cp:degree=2", "train", 2, "cpu", data="synthetic"), engine="cpu", ranks=2)
    assert row["status"] == "unsupported", row
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in row["message"], row["message"]
    assert "aten._scaled_dot_product_flash_attention.default" in row["message"], row["message"]


def test_what_the_row_says_is_what_pytorch_does_on_the_cpu():
    """PyTorch's own `context_parallel` on CPU tensors, in the fake process group: the CPU's SDPA kernel has no
    sharding strategy, as the row says."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel

    with fake_process_group(2, 0):
        mesh = DeviceMesh("cpu", [0, 1])
        tokens = torch.zeros(1, 64, dtype=torch.long)
        q, k, v = (torch.randn(1, 4, 32, 8) for _ in range(3))
        with context_parallel(mesh, buffers=[tokens], buffer_seq_dims=[1]):
            with pytest.raises(NotImplementedError, match="_scaled_dot_product_flash_attention_for_cpu"):
                F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_it_composes_with_fsdp_only():
    composed = parse_strategy("fsdp+cp:degree=2")
    assert [m.name for m in composed.members] == ["cp", "fsdp"]
    assert composed.members[0].data_parallel_place(3, 4) == (1, 2)
    for spec in ("cp+tp", "cp+ddp"):  # (cp and tp replace the backward, too)
        with pytest.raises(UsageError, match="cannot be combined"):
            parse_strategy(spec)
