"""The fake-CUDA dispatch's shortcuts give what torch's way gives: the dispatch-cache key
(`FakeCudaMode._prep_args_for_hash`) tells apart the arguments torch's own key tells apart, and no others, and an
operator answered from the cache gives what the uncached dispatch gives, for inputs that differ from one another in
one property each; the tracker answers a fake tensor's device as the fake mode does; the heap frozen while inside
`fake_cuda()` is thawed at the outermost exit."""

import gc
import itertools
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, _CacheKeyState, in_kernel_invocation_manager

from bench.measure.breakdown import CategorizedTracker
from bench.measure.fake_cuda_mode import FakeCudaMode, fake_cuda, heap_frozen

aten = torch.ops.aten


def _variants() -> dict[str, torch.Tensor]:
    """Inputs made inside a fake mode, each alike to another one but for one property: the key must tell them apart."""
    def bf16(*shape):
        return torch.empty(*shape, device="cuda", dtype=torch.bfloat16)

    def complex64():
        return torch.empty(4, 6, device="cuda", dtype=torch.complex64)

    with torch.inference_mode():
        inference = bf16(4, 6)
    return {
        "base": bf16(4, 6),
        "inference": inference,
        "host": torch.empty(4, 6, dtype=torch.bfloat16),
        "dtype": torch.empty(8, 6, device="cuda", dtype=torch.bfloat16)[:4],  # float32's 96 bytes, as "float32"
        "float32": torch.empty(4, 6, device="cuda", dtype=torch.float32),
        "shape": bf16(4, 6)[:3],  # base's strides and bytes
        "strides": bf16(6, 4).t(),  # base's shape
        "storage offset": bf16(5, 6)[1:],  # "storage bytes" but for the offset
        "storage bytes": bf16(5, 6)[:4],  # base but for the storage's bytes
        "requires grad": torch.empty(4, 6, device="cuda", dtype=torch.bfloat16, requires_grad=True),
        "conjugate": complex64().conj(),
        "plain complex": complex64(),
        "negative": complex64().conj().imag,  # the imaginary part of a conjugate view: its negative bit set
        "plain imaginary": complex64().imag,
    }


OPERATORS = {
    "clone": lambda t: aten.clone.default(t),
    "add": lambda t: aten.add.Tensor(t, t),
    "add scalar": lambda t: aten.add.Tensor(t, 2),
    "add float": lambda t: aten.add.Tensor(t, 2.0),
    "as_strided": lambda t: aten.as_strided.default(t, [2, 3], [3, 1]),
    "slice": lambda t: aten.slice.Tensor(t, 0, 1, 3),
    "transpose": lambda t: aten.transpose.int(t, 0, 1),
    "to float32": lambda t: aten._to_copy.default(t, dtype=torch.float32),
    "sum": lambda t: aten.sum.dim_IntList(t, [1]),
    "zero_": lambda t: aten.zero_.default(t.detach()),
    "detach": lambda t: aten.detach.default(t),
    "resolve_conj": lambda t: aten.resolve_conj.default(t),
    "resolve_neg": lambda t: aten.resolve_neg.default(t),
}


def _described(out, inputs: torch.Tensor):
    """What an operator gave: each output's metadata, and whether it is its input or shares its input's storage."""
    outs = out if isinstance(out, tuple) else (out,)
    return [(t.dtype, tuple(t.shape), t.stride(), t.device, t.storage_offset(), t.untyped_storage().nbytes(),
             t.requires_grad, t.is_conj(), t.is_neg(), t is inputs,
             t.untyped_storage()._cdata == inputs.untyped_storage()._cdata) for t in outs]


def _run(mode: FakeCudaMode, repeats: int) -> dict:
    results = {}
    with mode:
        variants = _variants()
        for op_name, op in OPERATORS.items():
            for variant, t in variants.items():
                for repeat in range(repeats):
                    try:
                        results[op_name, variant, repeat] = _described(op(t), t)
                    except RuntimeError as error:  # an operator that refuses a variant (its dtype, an inference tensor)
                        results[op_name, variant, repeat] = type(error).__name__
    return results


@pytest.mark.parametrize("first", [False, True], ids=["cold", "warm"])
def test_cached_operators_give_what_uncached_ones_give(first):
    torch.cuda.init()
    if first:  # every key in the cache already, made from another variant's call where a key would collide
        _run(FakeCudaMode(), 1)
    uncached = FakeCudaMode()
    uncached.cache_enabled = False
    expected = _run(uncached, 1)
    cached = FakeCudaMode()
    hits = FakeCudaMode.cache_info().hits
    got = _run(cached, 2)
    assert FakeCudaMode.cache_info().hits > hits  # the cache answered
    for (op_name, variant, repeat), described in got.items():
        assert described == expected[op_name, variant, 0], (op_name, variant, repeat)


def test_the_key_tells_apart_what_torchs_key_tells_apart():
    torch.cuda.init()
    mode = FakeCudaMode()
    with mode:
        variants = _variants()
    calls = [(aten.add.Tensor, (t, other), {}) for t in variants.values()
             for other in (2, 2.0, True, None, torch.float16, [1, 2], (1, 2), variants["base"])]
    calls += [(aten._to_copy.default, (t,), {"dtype": dtype}) for t in variants.values()
              for dtype in (torch.float32, torch.float16)]

    def keys(prep_args_for_hash):
        mode._prep_args_for_hash = types.MethodType(prep_args_for_hash, mode)
        try:
            return [mode._cache_key(_CacheKeyState(None), func, args, kwargs) for func, args, kwargs in calls]
        finally:
            del mode._prep_args_for_hash

    ours, torchs = keys(FakeCudaMode._prep_args_for_hash), keys(FakeTensorMode._prep_args_for_hash)
    assert len(set(ours)) == len(set(torchs)) > len(calls) // 2
    for (i, a), (j, b) in itertools.combinations(enumerate(ours), 2):
        assert (a == b) == (torchs[i] == torchs[j]), (calls[i], calls[j])


def test_the_tracker_answers_a_fake_tensors_device_as_the_fake_mode_does():
    mode = FakeCudaMode()
    with mode:
        t = torch.empty(2, 3, device="cuda")
        expected = torch.ops.prim.device.default(t)
        with in_kernel_invocation_manager(mode):
            expected_in_kernel = torch.ops.prim.device.default(t)
    assert (expected.type, expected_in_kernel.type) == ("cuda", "meta")
    with fake_cuda(), CategorizedTracker("cuda", block_bytes=512, record_events=True) as tracker:
        t = torch.empty(2, 3, device="cuda")
        tracker.track([t], "batch")
        assert torch.ops.prim.device.default(t) == expected
        assert torch.ops.prim.device.default(t.to(torch.bfloat16)) == expected
    # asking the device is no operator of the step
    assert [event.op for event in tracker.events if event.kind == "op"] == ["empty.memory_format", "_to_copy.default"]


def test_the_heap_is_frozen_inside_and_thawed_at_the_outermost_exit():
    assert gc.get_freeze_count() == 0
    with heap_frozen():
        frozen = gc.get_freeze_count()
        with heap_frozen():
            made_inside = [object() for _ in range(10)]
        assert gc.get_freeze_count() == frozen > 0  # the inner exit thawed nothing
    assert gc.get_freeze_count() == 0
    assert gc.is_tracked(made_inside) and made_inside


def test_unsafe_view_gives_what_torchs_fake_mode_gives():
    """FakeCudaMode answers `_unsafe_view` as a cached `view` (torch never caches it): each result is torch's own
    fake mode's, its storage its input's, and a size that cannot view the input raises as torch's does."""
    torch.cuda.init()

    def run(mode) -> dict:
        results = {}
        with mode:
            for variant, t in _variants().items():
                for size in ([-1], [2, -1], [1, *t.shape]):
                    try:
                        results[variant, tuple(size)] = _described(aten._unsafe_view.default(t, size), t)
                    except (RuntimeError, ValueError) as error:  # torch's reference implementation: ValueError
                        results[variant, tuple(size)] = type(error).__name__
        return results

    torchs = run(FakeTensorMode(allow_non_fake_inputs=True))
    hits = FakeCudaMode.cache_info().hits
    ours, again = run(FakeCudaMode()), run(FakeCudaMode())
    assert FakeCudaMode.cache_info().hits > hits
    assert ours == again == torchs
    assert sum(isinstance(result, list) and result[0][-1] for result in ours.values()) > 20  # views of their input
    assert {"RuntimeError", "ValueError"} & set(map(str, ours.values()))  # a transposed input cannot be viewed flat


def test_a_step_logs_the_same_events_with_unsafe_view_uncached(monkeypatch):
    """A Llama layer's LoRA step (matmuls of 3-d inputs, each followed by `_unsafe_view`) logs the same events, byte
    for byte, whether `_unsafe_view` takes torch's uncached way or the cached `view`."""
    from dataclasses import replace

    from bench.analysis.fake_engine import PredictionMeter, bound_device, tracked_step
    from bench.measure import fake_cuda_mode
    from bench.run.case import Case, bind_case

    case = Case("hf:llama-3.2-1b:seq_len=32:layers=2", "bf16_weights+qlora:scaler_block=8+checkpoint", "train", 2,
                "cuda")

    def events():
        planned = bind_case(replace(case, device=bound_device("fake-cuda")), 1)[0]
        planned.plan(PredictionMeter(case))
        return tracked_step(case, case.strategy, "fake-cuda", 1, record_events=True, planned=planned).events

    cached = events()
    monkeypatch.setattr(fake_cuda_mode, "_UNSAFE_VIEW", object())  # no operator is it: torch's way for every one
    uncached = events()
    assert sum(event.op == "_unsafe_view.default" for event in cached) > 10
    assert cached == uncached
