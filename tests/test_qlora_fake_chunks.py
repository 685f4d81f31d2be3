"""On fake tensors QLoRA quantises each weight layout once, in one chunk, and gives a weight of a layout met before
new empty tensors of that layout (strategies/qlora.py): the step's event log, hence every predicted byte, is the one
torchao's chunked quantisation of every weight gives, and torchao quantises once per layout."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from bench.analysis.fake_engine import PredictionMeter, bound_device, tracked_step
from bench.run.case import Case, bind_case
from bench.run.runner import MEMORY_WARMUP_STEPS
from strategies import qlora

# Llama-3.2-1B's widths (fake tensors: no memory), one layer: its weights are 4 to 16 of torchao's 1Mi-value chunks
CASE = Case("hf:llama-3.2-1b:seq_len=16:layers=1", "bf16_weights+qlora", "train", 1, "cuda")


def _log(monkeypatch, how: str) -> tuple[list, int]:
    """(the step's event log, how many chunks torchao quantised): "chunks", torchao's own chunks for every weight;
    "whole", every weight in one chunk; "layouts", as predict runs (each layout quantised once, in one chunk)."""
    nf4 = qlora.nf4_module()
    chunks = []
    nearest = nf4.NF4Tensor.quantize_tensor_nearest
    monkeypatch.setattr(nf4.NF4Tensor, "quantize_tensor_nearest",
                        staticmethod(lambda value, levels: chunks.append(1) or nearest(value, levels)))
    monkeypatch.setattr(qlora, "_NF4_LAYOUTS", {})
    if how == "chunks":
        monkeypatch.setattr(qlora, "_to_nf4", lambda module, weight, block, scaler_block:
                            module.to_nf4(weight, block, scaler_block))
    elif how == "whole":
        def whole(module, weight, block, scaler_block):
            with qlora._in_one_chunk_on_fake_tensors(module, weight):
                return module.to_nf4(weight, block, scaler_block)
        monkeypatch.setattr(qlora, "_to_nf4", whole)
    planned = bind_case(replace(CASE, device=bound_device("fake")), 1)[0]
    planned.plan(PredictionMeter(CASE))
    step = tracked_step(CASE, CASE.strategy, "fake", 1, cuda_autocast=True, record_events=True,
                        warmup_steps=MEMORY_WARMUP_STEPS["cuda"], planned=planned)
    monkeypatch.undo()
    return step.events, len(chunks)


def test_one_chunk_per_fake_weight_and_one_quantisation_per_layout_give_the_chunked_log(monkeypatch):
    chunked, chunk_count = _log(monkeypatch, "chunks")
    whole, whole_count = _log(monkeypatch, "whole")
    by_layout, layout_count = _log(monkeypatch, "layouts")
    assert whole == chunked
    assert by_layout == chunked
    assert whole_count == 7  # q, k, v, o, gate, up, down: one chunk each
    assert layout_count == 4  # q and o, k and v, gate and up, down
    assert chunk_count > 4 * whole_count


@pytest.mark.parametrize("shape, scaler_block", [((64, 512), 256), ((16, 64), 16), ((8, 64), 8)],
                         ids=["several scaler blocks", "one scaler block (a view of its 256 factors)", "tiny"])
def test_a_weight_of_a_layout_met_before_gets_torchaos_tensors(monkeypatch, shape, scaler_block):
    """The NF4Tensor made from a layout is torchao's for that weight: each inner tensor's shape, strides, offset,
    storage bytes and dtype, on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    nf4 = qlora.nf4_module()
    monkeypatch.setattr(qlora, "_NF4_LAYOUTS", {})

    def layout(tensor):
        return [(tuple(inner.shape), inner.stride(), inner.storage_offset(), inner.untyped_storage().nbytes(),
                 inner.dtype) for inner in (getattr(tensor, name) for name in qlora._NF4_INNER)]

    with FakeTensorMode():
        weights = [torch.empty(shape, dtype=torch.bfloat16) for _ in range(2)]
        with qlora._in_one_chunk_on_fake_tensors(nf4, weights[0]):
            torchaos = nf4.to_nf4(weights[1], 64, scaler_block)
        first, second = (qlora._to_nf4(nf4, weight, 64, scaler_block) for weight in weights)
    assert len(qlora._NF4_LAYOUTS) == 1
    assert layout(first) == layout(second) == layout(torchaos)
    assert (second.shape, second.stride(), second.dtype) == (torchaos.shape, torchaos.stride(), torchaos.dtype)
    assert (second.block_size, second.n_blocks, second.scaler_block_size) == (64, weights[1].numel() // 64,
                                                                            scaler_block)
    stored = {id(inner.untyped_storage()) for inner in (getattr(second, name) for name in qlora._NF4_INNER)}
    assert len(stored) == len(qlora._NF4_INNER)  # a storage each, as torchao's
