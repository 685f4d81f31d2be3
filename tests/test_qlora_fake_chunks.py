"""On fake tensors QLoRA quantises each weight in one chunk (strategies/qlora.py): the step's event log, hence every
predicted byte, is the one torchao's chunked quantisation gives, and the chunk loop runs once per weight."""

from __future__ import annotations

from dataclasses import replace

from bench.analysis.fake_engine import PredictionMeter, bound_device, tracked_step
from bench.run.case import Case, bind_case
from bench.run.runner import MEMORY_WARMUP_STEPS
from strategies import qlora

# Llama-3.2-1B's widths (fake tensors: no memory), one layer: its weights are 4 to 16 of torchao's 1Mi-value chunks
CASE = Case("hf:llama-3.2-1b:seq_len=16:layers=1", "bf16_weights+qlora", "train", 1, "cuda")


def _log(monkeypatch, in_chunks: bool) -> tuple[list, int]:
    """(the step's event log, how many chunks torchao quantised), torchao's own chunks where `in_chunks`."""
    nf4 = qlora.nf4_module()
    chunks = []
    nearest = nf4.NF4Tensor.quantize_tensor_nearest
    monkeypatch.setattr(nf4.NF4Tensor, "quantize_tensor_nearest",
                        staticmethod(lambda value, levels: chunks.append(1) or nearest(value, levels)))
    if in_chunks:
        monkeypatch.setattr(qlora, "_in_one_chunk_on_fake_tensors", lambda module, weight: _Nothing())
    planned = bind_case(replace(CASE, device=bound_device("fake")), 1)[0]
    planned.plan(PredictionMeter(CASE))
    step = tracked_step(CASE, CASE.strategy, "fake", 1, cuda_autocast=True, record_events=True,
                        warmup_steps=MEMORY_WARMUP_STEPS["cuda"], planned=planned)
    monkeypatch.undo()
    return step.events, len(chunks)


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_one_chunk_per_fake_weight_gives_the_chunked_log(monkeypatch):
    chunked, chunk_count = _log(monkeypatch, in_chunks=True)
    whole, whole_count = _log(monkeypatch, in_chunks=False)
    assert whole == chunked
    assert whole_count == 7  # q, k, v, o, gate, up, down: one chunk each
    assert chunk_count > 4 * whole_count
