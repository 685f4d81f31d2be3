"""Context parallelism (`cp:degree=N`, strategies/cp.py) on the CPU: PyTorch's `context_parallel` does not put the
CPU's attention kernel in its ring (this file checks that against PyTorch itself, the reason strategies/cp.py
registers it), and with it there the CPU prediction runs each rank on half of every sample's tokens, the ring's
all-gathers adding communication buffers to FSDP2's. Real gloo ranks against the prediction, to the byte:
tests/test_cp_ranks.py; on fake CUDA: tests_cuda_fake/test_cp_fake_cuda.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.analysis.fake_engine import tracked_step
from bench.core.errors import UsageError
from bench.core.memory_categories import COMMUNICATION
from bench.run.case import Case
from bench.run.ranks import fake_process_group
from strategies import parse_strategy
from strategies.cp import CPU_ATTENTION, _cpu_kernel_in_the_ring

pytest.importorskip("transformers")

SEQ_LEN = 16
LLAMA = f"hf:tiny-llama:seq_len={SEQ_LEN}"
SAMPLES = 2


def _ring_attention_of_pytorch(mesh, q, k, v):
    """Causal attention on the head-and-tail shards of a 64-token sequence, under PyTorch's own `context_parallel`."""
    from torch.distributed.tensor.experimental import context_parallel

    tokens = torch.zeros(1, 64, dtype=torch.long)
    with context_parallel(mesh, buffers=[tokens], buffer_seq_dims=[1]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_pytorch_puts_no_cpu_kernel_in_its_ring_and_the_strategy_does():
    """PyTorch's ring attention on CPU tensors (fake process group): the CPU's kernel has no sharding strategy, so
    PyTorch raises; with `_cpu_kernel_in_the_ring` the same call runs PyTorch's ring around that kernel and gives
    each rank the attention of its own 32 tokens. When PyTorch handles the CPU kernel itself, the first half fails:
    then `_cpu_kernel_in_the_ring` steps aside (it does where PyTorch's `custom_ops` has the kernel)."""
    from torch.distributed.device_mesh import DeviceMesh

    with fake_process_group(2, 0):
        mesh = DeviceMesh("cpu", [0, 1])
        q, k, v = (torch.randn(1, 4, 32, 8) for _ in range(3))
        with pytest.raises(NotImplementedError, match=CPU_ATTENTION.name().split("::")[1]):
            _ring_attention_of_pytorch(mesh, q, k, v)
        with _cpu_kernel_in_the_ring():
            out = _ring_attention_of_pytorch(mesh, q, k, v)
        assert type(out) is torch.Tensor and out.shape == q.shape


def _first_rank_step(spec: str):
    """Rank 0's tracked step on 2 ranks (the real ranks' check traces both: tests/test_cp_ranks.py)."""
    case = Case(LLAMA, spec, "train", SAMPLES, "cpu", data="synthetic", warmup=0, steps=1)
    with fake_process_group(2, 0):
        return tracked_step(case, spec, "cpu", ranks=2, cuda_autocast=False, record_events=True)


def _communication_bytes(step, stage: str) -> int:
    window = max(i for i, event in enumerate(step.events) if event.kind == "reset")
    return sum(event.nbytes for event in step.events[window:]
               if event.kind == "alloc" and event.category == COMMUNICATION and event.stage == stage)


def test_on_the_cpu_each_rank_holds_half_of_every_sample_and_the_ring_adds_its_buffers():
    ring, plain = _first_rank_step("fsdp+cp:degree=2"), _first_rank_step("fsdp")
    # its batch: the input ids, their positions and the target, int64, for every sample and half its tokens
    assert ring.peak_by_category["batch"] == 3 * SAMPLES * (SEQ_LEN // 2) * 8
    assert _communication_bytes(ring, "forward") > _communication_bytes(plain, "forward")
    assert _communication_bytes(ring, "backward") > _communication_bytes(plain, "backward")


def test_it_composes_with_fsdp_only():
    composed = parse_strategy("fsdp+cp:degree=2")
    assert [m.name for m in composed.members] == ["cp", "fsdp"]
    assert composed.members[0].data_parallel_place(3, 4) == (1, 2)
    for spec in ("cp+tp", "cp+ddp"):  # (cp and tp replace the backward, too)
        with pytest.raises(UsageError, match="cannot be combined"):
            parse_strategy(spec)
