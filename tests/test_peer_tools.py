"""The peers' tools for sharded training (tools/peers/*.py): their arguments and the arithmetic of their comparison,
without running a peer (the runs themselves take minutes: results/reference/peers/sharded/)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def tool(name: str):
    """tools/peers/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "peers" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def test_tracker_splits_the_global_batch_as_membench_does():
    tracker = tool("fsdp_mem_tracker")
    assert [tracker.local_batch(9, 4, rank) for rank in range(4)] == [3, 2, 2, 2]  # torch.tensor_split's split
    assert [tracker.local_batch(8, 8, rank) for rank in range(8)] == [1] * 8
    args = tracker.parse_args(["--ranks", "4", "--batch-size", "9", "--checkpoint"])
    assert (args.ranks, args.batch_size, args.checkpoint, args.steps, args.device) == (4, 9, True, 2, "cuda")
    with pytest.raises(SystemExit):
        tracker.parse_args(["--ranks", "8", "--batch-size", "4"])  # fewer samples than ranks
    with pytest.raises(SystemExit):
        tracker.parse_args(["--ranks", "2", "--rank", "2"])


def test_tracker_compares_with_membench_s_row(tmp_path):
    tracker = tool("fsdp_mem_tracker")
    csv_file = tmp_path / "predict.csv"
    csv_file.write_text("strategy,phase,status,predicted_bytes,predicted_reserved_bytes\n"
                        "baseline,train,ok,100,200\nfsdp,train,ok,1100,1200\n"
                        "checkpoint:segments=all+fsdp,train,ok,500,600\n")
    row = tracker.predict_row(csv_file, tracker.membench_strategy(checkpoint=True))
    assert row["predicted_bytes"] == "500"
    assert tracker.predict_row(csv_file, tracker.membench_strategy(checkpoint=False))["predicted_bytes"] == "1100"
    result = tracker.comparison(1000, 1100, 1200)
    assert result["allocated_minus_tracker_bytes"] == 100 and result["allocated_over_tracker"] == 1.1
    assert result["reserved_minus_tracker_bytes"] == 200 and result["reserved_over_tracker"] == 1.2
    assert "membench_reserved_bytes" not in tracker.comparison(1000, 900)


def test_deepspeed_formula_and_arguments():
    ds = tool("deepspeed_zero3")
    # llama-3.2-1b's counts on 8 GPUs: 4 bytes per parameter of the largest layer + 18 per parameter / GPUs
    assert ds.zero3_gpu_bytes(1_235_814_400, 262_668_288, 8) == 4 * 262_668_288 + 18 * 1_235_814_400 // 8
    args = ds.parse_args(["--presets", "llama-3.2-1b", "--gpus", "2,8"])
    assert args.presets == ["llama-3.2-1b"] and args.gpus == [2, 8] and args.live == []


def test_sharded_table_configurations():
    table = tool("sharded_table")
    args = table.parse_args(["--out", "x", "--configs", "llama-3.2-1b:2048:8:8,tiny-llama:16:2:4",
                             "--variants", "shipped"])
    assert args.configs[0] == {"preset": "llama-3.2-1b", "seq_len": 2048, "ranks": 8, "global_batch": 8}
    assert table.config_name(args.configs[1]) == "tiny-llama-s16-r2-b4"
    with pytest.raises(SystemExit):
        table.parse_args(["--out", "x", "--configs", "llama-3.2-1b:2048:8"])
    with pytest.raises(SystemExit):
        table.parse_args(["--out", "x", "--variants", "real"])
