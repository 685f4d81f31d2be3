"""Memory snapshots in PyTorch's format (`--snapshot`): each kind written (the CPU's exact count, the fake engine's
prediction, CUDA's predicted allocator, per rank) is read back with PyTorch's own `torch.cuda._memory_viz`, and the
peaks its trace replays to equal the row's `peak_mem_bytes` (and `predicted_reserved_bytes`); the report sets a
sharded case's ranks side by side.

Small: a 4-layer MLP at batch 2, and the captcha ResNet at batch 2 on fake tensors where segments of both pools
matter.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.cuda import _memory_viz

from bench.analysis import predict
from bench.cli.main import main
from bench.measure import fake_cuda
from bench.report.html import report_data
from bench.core.results import write_rows
from bench.core.snapshots import CATEGORIES, category_timeline, read_snapshot, replay_peaks, snapshot_folder
from bench.run.isolation import RunOptions
from bench.run.case import Case
from bench.run.runner import run_case

MLP = "deep_mlp:layers=4:width=8"
UNIFORM = "deep_mlp:layers=24:width=8"  # as tests/test_ranks.py: zero1 halves its optimizer state exactly


def _case(strategy: str = "baseline", device: str = "cpu", workload: str = MLP, phase: str = "train",
          batch: int = 2) -> Case:
    return Case(workload, strategy, phase, batch, device, data="synthetic", warmup=0, steps=1)


def _snapshots(folder: Path) -> list[dict]:
    return [read_snapshot(path) for path in sorted(Path(folder).glob("*.pickle"))]


def _read_by_memory_viz(snapshot: dict) -> None:
    """PyTorch's own readers take the snapshot: the timeline page, and the segment summary, which checks that
    every segment's blocks account for its bytes (an AssertionError otherwise)."""
    page = _memory_viz.trace_plot(snapshot)
    assert "snapshot.pickle" in page and "Active Memory Timeline" in page
    assert "total_reserved" in _memory_viz.segsum(snapshot)
    assert "entries" in _memory_viz.trace(snapshot)


def test_cpu_measured_snapshot_replays_to_the_rows_peak_and_its_breakdown(tmp_path):
    row = run_case(_case("checkpoint"), env={}, options=RunOptions(threads=1, snapshot_dir=str(tmp_path)))
    assert row["status"] == "ok", row["message"]
    # recording (events, module hooks, autograd-node metadata) changes no tensor: the same peak as without it
    unrecorded = run_case(_case("checkpoint"), env={}, options=RunOptions(threads=1))
    assert unrecorded["peak_mem_bytes"] == row["peak_mem_bytes"]
    [snapshot] = _snapshots(tmp_path)
    _read_by_memory_viz(snapshot)
    assert snapshot["membench"]["strategy"] == row["strategy"] and snapshot["membench"]["kind"] == "measured"
    assert replay_peaks(snapshot) == (row["peak_mem_bytes"], None)
    timeline = category_timeline(snapshot)
    assert timeline.peak_bytes == row["peak_mem_bytes"] and timeline.peak_stage == row["peak_stage"]
    at_peak = {c: timeline.live[c][timeline.peak_position] for c in CATEGORIES}
    # categories that never change are exact; a gradient counts as one from its creation (the row files it as a
    # temporary until it is accumulated), so only their sum is
    assert at_peak["weights"] == row["peak_params_bytes"] and at_peak["batch"] == row["peak_batch_bytes"]
    assert at_peak["optimizer_state"] == row["peak_optimizer_bytes"]
    assert at_peak["activations"] == row["peak_activations_bytes"]
    assert at_peak["gradients"] + at_peak["temporaries"] == row["peak_grads_bytes"] + row["peak_temp_bytes"]
    allocs = [e for e in snapshot["device_traces"][0] if e["action"] == "alloc"]
    assert {e["stage"] for e in allocs} >= {"forward", "backward", "optimizer"}
    # frames name the operator, the module and the stage; the forward's allocations are the model's layers'
    assert any(e["module"] in ("0", "1", "2", "3") and e["stage"] == "forward" for e in allocs)
    assert [f["filename"] for f in allocs[-1]["frames"]] == ["operator", "module", "stage"]


def test_fake_engine_prediction_snapshot_replays_to_the_predicted_peak(tmp_path):
    row = predict.predict_case(_case("checkpoint"), engine="fake", snapshot_dir=str(tmp_path))
    [snapshot] = _snapshots(tmp_path)
    _read_by_memory_viz(snapshot)
    assert snapshot["membench"]["kind"] == "predicted" and snapshot["membench"]["engine"] == "fake"
    assert replay_peaks(snapshot) == (row["predicted_bytes"], None)


def test_cuda_prediction_snapshot_holds_the_allocators_blocks_and_segments(tmp_path):
    row = predict.predict_case(_case("checkpoint", "cuda", "captcha_resnet18"), engine="fake",
                               snapshot_dir=str(tmp_path))
    [snapshot] = _snapshots(tmp_path)
    _read_by_memory_viz(snapshot)
    assert replay_peaks(snapshot) == (row["predicted_bytes"], row["predicted_reserved_bytes"])
    # reserved memory only grows in the model: the segments at the end are the peak, in both pools
    segments = snapshot["segments"]
    assert sum(s["total_size"] for s in segments) == row["predicted_reserved_bytes"]
    assert {s["segment_type"] for s in segments} == {"small", "large"}
    assert all(sum(b["size"] for b in s["blocks"]) == s["total_size"] for s in segments)
    blocks = [e for e in snapshot["device_traces"][0] if e["action"] == "alloc"]
    assert all(e["size"] % 512 == 0 for e in blocks)  # the allocator's rounded blocks, as memory_allocated counts
    assert any(e["module"].startswith("cuBLAS workspace") for e in blocks) == bool(row["cublas_workspace_bytes"])


def test_fake_cuda_prediction_snapshot(tmp_path, monkeypatch):
    # this checkout's environment, which tests/conftest.py hides from the other tests
    monkeypatch.setattr(fake_cuda, "VENV", Path(__file__).resolve().parents[1] / ".venv-cuda-fake")
    if fake_cuda.environment_python() is None:
        pytest.skip(fake_cuda.unavailable_reason())
    [row] = predict.predict_cases([_case("checkpoint", "cuda")], engine="fake-cuda", snapshot_dir=str(tmp_path))
    assert row["engine"] == "fake-cuda", row["message"]
    [snapshot] = _snapshots(tmp_path)
    _read_by_memory_viz(snapshot)
    assert replay_peaks(snapshot) == (row["predicted_bytes"], row["predicted_reserved_bytes"])


@pytest.mark.slow  # in .ci/run's long tests of make test
def test_each_rank_writes_its_snapshot_with_its_own_peak_and_the_report_sets_them_side_by_side(tmp_path):
    results = tmp_path / "20990101T000000Z-cpu-rank.csv"
    row = run_case(_case("zero1", workload=UNIFORM), env={},
                   options=RunOptions(threads=1, ranks=2, snapshot_dir=str(snapshot_folder(results))))
    assert row["status"] == "ok", row["message"]
    snapshots = _snapshots(snapshot_folder(results))
    assert sorted(s["membench"]["rank"] for s in snapshots) == [0, 1]
    peaks = sorted(replay_peaks(s)[0] for s in snapshots)
    assert peaks == [row["rank_peak_min_bytes"], row["rank_peak_max_bytes"]]
    for snapshot in snapshots:
        _read_by_memory_viz(snapshot)
    write_rows([row], results)
    [case] = report_data([results])["timelines"]
    assert [t["rank"] for t in case["ranks"]] == [0, 1] and case["row_peak_bytes"] == row["peak_mem_bytes"]
    assert sorted(t["peak"]["bytes"] for t in case["ranks"]) == peaks


def test_snapshot_options_write_beside_the_table(tmp_path, capsys):
    assert main(["predict", "--device", "cpu", "--workload", MLP, "--batch-size", "2", "--phases", "eval",
                 "--snapshot", "--out", str(tmp_path)]) == 0
    [folder] = tmp_path.glob("predict-*.snapshots")
    [csv] = tmp_path.glob("predict-*.csv")
    assert folder.name == csv.stem + ".snapshots" and len(list(folder.glob("*.pickle"))) == 1
    assert main(["explain", "--strategy", "baseline", "--workload", MLP, "--batch-size", "2", "--snapshot",
                 "--out", str(tmp_path)]) == 0
    assert "pytorch.org/memory_viz" in capsys.readouterr().out
    assert len(list(tmp_path.glob("explain-*.snapshots/*.pickle"))) == 1


@pytest.mark.cuda
def test_cuda_snapshot_is_recorded_by_the_allocator(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    row = run_case(_case("checkpoint", "cuda", "captcha_resnet18", batch=8), env={},
                   options=RunOptions(threads=1, snapshot_dir=str(tmp_path)))
    assert row["status"] == "ok", row["message"]
    [snapshot] = _snapshots(tmp_path)
    assert snapshot["membench"]["source"] == "cuda_record_memory_history"
    _read_by_memory_viz(snapshot)
    allocated, _ = replay_peaks(snapshot)
    # CUDA's trace records the bytes requested, max_memory_allocated the blocks handed out (rounded to 512 B or more)
    assert 0.95 * row["peak_mem_bytes"] <= allocated <= row["peak_mem_bytes"]


def test_the_backward_of_a_linear_layer_names_its_module_as_the_forward_does(tmp_path):
    """A Linear on a 3-d input ends its forward in a view, behind which its MmBackward0 lies: the backward's
    allocations name the layer (`1 (MmBackward0)`), as the forward's do, and the largest live tensors at the peak
    say their size, category, module and operator."""
    from bench.core.snapshots import largest_live
    from bench.measure import memory
    from bench.measure.snapshot import ModuleScope

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4, bias=False))
    tracker = memory.LiveTensorTracker("cpu", record_events=True)
    with ModuleScope(model, tracker) as scope:
        loss = model(torch.rand(2, 3, 8)).sum()
        names = {}
        for node in _nodes(loss.grad_fn):
            names[node.name()] = node.metadata.get(ModuleScope.METADATA_KEY)
        seen = []
        hook = lambda *_: seen.append(scope.current())  # noqa: E731 - the module named while each node runs
        handles = [n.register_prehook(hook) for n in _nodes(loss.grad_fn) if n.name() == "MmBackward0"]
        loss.backward()
    for handle in handles:
        handle.remove()
    assert names["AddmmBackward0"] == "0" and names["ReluBackward0"] == "1" and names["MmBackward0"] == "2"
    assert seen and all(s == "2 (MmBackward0)" for s in seen), seen
    trace = [{"action": "alloc", "addr": i, "size": s, "category": c, "module": m, "op": "mm", "stage": "backward"}
             for i, (s, c, m) in enumerate([(10, "activations", "0"), (30, "gradients", "2 (MmBackward0)")])]
    assert largest_live({"device_traces": [trace]}, 1)[0] == {"bytes": 30, "category": "gradients",
                                                              "module": "2 (MmBackward0)", "op": "mm",
                                                              "stage": "backward"}


def _nodes(root):
    out, pending, seen = [], [root], set()
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        out.append(node)
        pending.extend(n for n, _ in node.next_functions)
    return out


def test_a_forward_that_raises_leaves_the_module_scope():
    """torch.utils.checkpoint stops a recomputation early by raising inside the modules' forwards: the scope must
    not go on naming those modules for every allocation after it."""
    from bench.measure import memory
    from bench.measure.snapshot import ModuleScope

    class Stops(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("stop")

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Stops())
    with ModuleScope(model, memory.LiveTensorTracker("cpu", record_events=True)) as scope:
        with pytest.raises(RuntimeError, match="stop"):
            model(torch.rand(1, 2))
        assert scope.current() == "" and scope.stack == []
