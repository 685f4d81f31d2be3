"""Context parallelism (`fsdp+cp:degree=2`, strategies/cp.py) predicted per rank on fake CUDA, where PyTorch's ring
attention runs (on CUDA's flash kernel, with a 16-bit compute dtype): each rank holds its head-and-tail half of every
sample's tokens, and the ring's all-gathers of keys and values add communication buffers to FSDP2's; float32
attention, which CUDA runs on a kernel ring attention does not handle, is an `unsupported` row saying so. Real gloo
ranks check the same ring on the CPU, with the CPU's kernel in it (tests/test_cp_ranks.py); CUDA's kernels in the
ring are checked by no real run."""

from __future__ import annotations

import pytest
import torch

from bench.analysis.fake_engine import tracked_step
from bench.analysis.predict import predict_case
from bench.core.memory_categories import COMMUNICATION
from bench.run.case import Case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs the fake-CUDA environment's torch")
pytest.importorskip("transformers")

SEQ_LEN = 128  # 64 tokens a rank: the memory-efficient kernel's log-sum-exp is padded to 32 (strategies/cp.py)
LLAMA = f"hf:tiny-llama:seq_len={SEQ_LEN}"
MIXED = "fsdp:param_dtype=bfloat16:reduce_dtype=float32"
SAMPLES = 2


def _step(spec: str):
    case = Case(LLAMA, spec, "train", SAMPLES, "cuda", data="synthetic")
    return tracked_step(case, spec, "fake-cuda", ranks=2, record_events=True, warmup_steps=1)


def _communication_bytes(step, stage: str) -> int:
    window = max(i for i, event in enumerate(step.events) if event.kind == "reset")
    return sum(event.nbytes for event in step.events[window:]
               if event.kind == "alloc" and event.category == COMMUNICATION and event.stage == stage)


def test_each_rank_holds_half_of_every_sample_and_the_ring_adds_its_buffers():
    ring, plain = _step(f"{MIXED}+cp:degree=2"), _step(MIXED)
    assert ring.ranks_traced == (0, 1)
    # its batch: the input ids, their positions and the target, int64, for every sample and half its tokens
    assert ring.peak_by_category["batch"] == 3 * SAMPLES * (SEQ_LEN // 2) * 8
    assert _communication_bytes(ring, "forward") > _communication_bytes(plain, "forward")


def test_float32_attention_is_an_unsupported_row_naming_ring_attentions_kernels():
    row = predict_case(Case(LLAMA, "fsdp+cp:degree=2", "train", SAMPLES, "cuda", data="synthetic"),
                       engine="fake-cuda", ranks=2)
    assert row["status"] == "unsupported" and "did not run as ring attention" in row["message"], row
