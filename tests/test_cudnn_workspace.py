"""cuDNN's convolution workspaces in a prediction (bench.measure.cudnn_workspace): each call's from the table measured
on an H200, estimated from other batch sizes, counted at the peak while the call runs and filed as a workspace."""

from __future__ import annotations

import torch

from bench.core import memory_categories
from bench.measure import cuda_allocator, memory
from bench.measure.cudnn_workspace import (
    TABLES, ConvolutionWorkspaces, _table, estimated_from_other_batches, signature,
)

CONV_64 = torch.ops.aten.convolution.default


def _conv_args(batch: int, dtype=torch.float32) -> tuple:
    data = torch.empty(batch, 64, 56, 24, dtype=dtype)
    weight = torch.empty(64, 64, 3, 3, dtype=dtype)
    return (data, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)


def test_a_call_is_keyed_by_pass_dtype_shapes_parameters_layout_and_mode():
    key = signature("convolution", _conv_args(32))
    assert key == "forward|float32|32x64x56x24|64x64x3x3|1x1|1x1|1x1|false|1||contiguous|heuristics"
    grad = torch.empty(32, 64, 56, 24)
    backward = (grad, *_conv_args(32)[:2], [0], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False])
    assert signature("convolution_backward", backward).startswith("backward|float32|32x64x56x24|64x64x3x3|")
    assert signature("convolution_backward", backward).endswith("|110|contiguous|heuristics")
    assert signature("addmm", ()) is None


def test_the_table_holds_the_h200s_calls_as_it_measured_them():
    table = _table(TABLES[(9, 0)])
    # the 3x3 convolution from 64 to 64 channels on captcha's 56x24 images, forward: about its input's bytes up
    # to batch 64, twice them from batch 100 (the heuristics' engine changes)
    assert table[signature("convolution", _conv_args(32))] == 11_158_016
    assert table[signature("convolution", _conv_args(100))] == 69_206_016
    assert len(table) > 1000


def test_a_batch_the_table_lacks_is_estimated_between_measured_ones_and_said():
    measured = [(8, 1000), (32, 4000)]
    assert estimated_from_other_batches(measured, 16) == 2000
    assert estimated_from_other_batches(measured, 64) == 8000  # above: in proportion
    assert estimated_from_other_batches(measured, 2) == 1000  # below: the smallest's
    sizes = ConvolutionWorkspaces((9, 0))
    assert sizes(CONV_64, _conv_args(32)) == 11_158_016
    between = sizes(CONV_64, _conv_args(30))  # measured at 25 and 32
    assert 8_749_568 < between < 11_158_016
    assert sizes(torch.ops.aten.addmm.default, ()) == 0
    assert (sizes.found, sizes.estimated, sizes.missing) == (1, 1, 0)
    assert "1 of 2 calls estimated" in sizes.note()
    other = ConvolutionWorkspaces((8, 6))
    assert other(CONV_64, _conv_args(32)) == 0 and "not 8.6" in other.note()
    assert ConvolutionWorkspaces((9, 0)).note() is None  # no convolution ran


def test_the_workspace_is_held_after_the_outputs_at_the_peak_then_freed():
    workspace = 5_000_000
    tracker = memory.LiveTensorTracker("cpu", record_events=True)
    tracker.op_workspace = lambda func, args: (((workspace, memory_categories.CUDNN_WORKSPACE),)
                                               if func is CONV_64 else ())
    data, weight = torch.randn(2, 64, 8, 8), torch.randn(64, 64, 3, 3)
    with tracker:
        tracker.reset_peak()
        out = torch.ops.aten.convolution.default(data, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        after = tracker.live_bytes
    assert tracker.peak_bytes == after + workspace  # the output was live while the workspace was
    allocs = [e for e in tracker.events if e.kind == "alloc"]
    assert allocs[-1].nbytes == workspace and allocs[-1].category == memory_categories.CUDNN_WORKSPACE
    assert tracker.events[-1].kind == "free" and tracker.events[-1].key == allocs[-1].key
    replayed = cuda_allocator.replay(tracker.events, 0)
    assert replayed.peak_by_category[memory_categories.CUDNN_WORKSPACE] == -(-workspace // 512) * 512
    del out


def test_the_table_is_rebuilt_from_the_leases_probe_files_unchanged(tmp_path):
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("conv_workspace", root / "tools" / "gpu" / "conv_workspace.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    lease = root / "results" / "reference" / "gpu" / "h200-20261130" / "lease1"
    probe.build_table(sorted(lease.glob("conv-*.csv"), key=str), tmp_path / "table.csv")
    rebuilt = [line for line in (tmp_path / "table.csv").read_text().splitlines()]
    committed = TABLES[(9, 0)].read_text().splitlines()
    # the files of CUDNN_CONV_WSCAP_DBG=1 held the same bytes per call as the others (it caps nothing here)
    assert rebuilt == committed
