"""Memory analysis: breakdown of the peak, rule of thumb, explain, predict, fit, and CUDA OOM handling.

Fast: synthetic data, batch sizes 2-3; expensive tracked passes are computed once and shared.
"""

import functools
import gc

import pandas as pd
import pytest
import torch

from bench.analysis import fake_engine, fit as fitting
from bench.cli.arguments import size_option
from bench.cli.main import main
from bench.core.errors import Unsupported, UsageError
from bench.core.results import FIT, FIT_SCHEMA_VERSION
from bench.measure import breakdown
from bench.measure.breakdown import BREAKDOWN_COLUMNS
from bench.measure.memory import LiveTensorTracker
from bench.run.rule_of_thumb import rule_of_thumb
from bench.run.case import Case, bind_case
from bench.run.runner import memory_pass, run_case
from strategies import STRATEGIES

WL = "captcha_resnet18"


def case(strategy="baseline", phase="train", batch=2, device="cpu", **kw):
    return Case(WL, strategy, phase, batch, device, data="synthetic", warmup=0, steps=1, **kw)


@functools.lru_cache(maxsize=None)
def applicable_or_skip(strategy: str, phase: str, device: str):
    """The bound strategy, or a skip when it does not apply to this phase or device."""
    strat, context = bind_case(case(strategy, phase, device=device))
    try:
        strat.check(context)
    except Unsupported as reason:
        pytest.skip(str(reason))
    return strat


@functools.lru_cache(maxsize=None)
def tracked(strategy: str, phase: str, batch: int) -> dict:
    """One exact CPU memory pass (cached: the tests share it)."""
    strat, _ = bind_case(case(strategy, phase, batch))
    return dict(memory_pass(case(strategy, phase, batch), strat))  # the columns, without the tracker


# --- size options ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("1e9", 10**9), ("1.5GB", 1_500_000_000), ("300000", 300_000),
    ("2 gib", 2 * 2**30), ("64KiB", 65536),
])
def test_size_option_reads_units(text, expected):
    assert size_option(text, "--budget") == expected


@pytest.mark.parametrize("text", ["", "4XB", "-1GiB", "0", "GiB", "1e999"])
def test_size_option_rejects(text):
    with pytest.raises(UsageError):
        size_option(text, "--budget")


# --- breakdown ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def n_params() -> int:
    """The workload's parameter count, its model built once for every breakdown case."""
    return sum(p.numel() for p in __import__("workloads").get_workload(WL).build_model().parameters())


@pytest.mark.parametrize("phase", ["train", "eval"])
@pytest.mark.parametrize("strategy", STRATEGIES.names())
def test_breakdown_adds_up_to_the_peak(strategy, phase, n_params):
    bound = applicable_or_skip(strategy, phase, "cpu")  # no_grad_eval in training, cudnn_benchmark on the CPU
    if bound.cpu_memory_count != "live_tensors":
        pytest.skip(f"{strategy}: counted at the CPU allocator, which files bytes under no category")
    memory = tracked(strategy, phase, 2)
    assert sum(memory[c] for c in BREAKDOWN_COLUMNS) == memory["peak_mem_bytes"]
    assert all(memory[c] >= 0 for c in BREAKDOWN_COLUMNS)
    bytes_per_param = 2 if strategy == "bf16_weights" else 4  # the one strategy that stores the weights in 16 bits
    assert memory["peak_params_bytes"] == bytes_per_param * n_params
    assert memory["peak_batch_bytes"] > 0
    if strategy == "baseline" and phase == "train":
        assert memory["peak_optimizer_bytes"] >= 2 * 4 * n_params  # Adam's exp_avg and exp_avg_sq
        assert memory["peak_grads_bytes"] == 4 * n_params  # the peak is after backward: every .grad exists
    if phase == "eval":
        assert memory["peak_grads_bytes"] == memory["peak_optimizer_bytes"] == 0
        assert memory["peak_activations_bytes"] > 0


def test_breakdown_files_grads_state_and_activations():
    """A toy step with known sizes: each category gets exactly its storages."""
    w = torch.ones(1000, requires_grad=True)  # 4,000 params

    class Toy:
        optimizer = torch.optim.Adam([w])

        def parameters(self):
            return [w]

        def optimizer_state(self):
            return [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]

        def watch_grads(self, callback):
            return w.register_post_accumulate_grad_hook(callback)

    toy = Toy()
    with LiveTensorTracker() as tracker:
        tracker.track([w], "params")
        for step in range(2):
            if step == 1:
                handles = breakdown.prepare_breakdown(toy, tracker)
                tracker.reset_peak()
            tracker.stage = "forward"
            loss = torch.sigmoid(w).sum()  # saves sigmoid's output (4,000) for backward
            tracker.stage = "backward"
            loss.backward()
            tracker.stage = "optimizer"
            toy.optimizer.step()
            toy.optimizer.zero_grad()
        for h in handles:
            h.remove()
    columns = breakdown.breakdown_columns(tracker)
    assert sum(columns.values()) == tracker.peak_bytes
    assert columns["peak_params_bytes"] == 4000
    assert columns["peak_optimizer_bytes"] >= 8000  # exp_avg, exp_avg_sq (+ step)
    assert tracker.peak_stage == "optimizer" and columns["peak_grads_bytes"] == 4000


def test_run_case_row_has_breakdown_and_rule_of_thumb():
    row = run_case(case(phase="eval"))
    assert row["status"] == "ok", row["message"]
    assert sum(row[c] for c in BREAKDOWN_COLUMNS) == row["peak_mem_bytes"]
    assert row["rule_of_thumb_bytes"] > 0


def test_rule_of_thumb():
    train, evl = rule_of_thumb(WL, "train", 2), rule_of_thumb(WL, "eval", 2)
    assert train["params_bytes"] == 4 * 11_242_704 == evl["params_bytes"]
    assert train["optimizer_bytes"] == 2 * train["params_bytes"] and evl["optimizer_bytes"] == 0
    assert train["total_bytes"] == train["params_bytes"] * 3 + 2 * train["outputs_bytes"]
    assert evl["total_bytes"] == evl["params_bytes"] + evl["outputs_bytes"]
    assert rule_of_thumb(WL, "eval", 4)["outputs_bytes"] == 2 * evl["outputs_bytes"]


# --- explain / predict / fit ----------------------------------------------------------------------------

def test_explain_prints_breakdown_rule_and_modules(capsys):
    assert main(["explain", "--strategy", "baseline", "--batch-size", "2", "--phase", "eval"]) == 0
    out = capsys.readouterr().out
    for word in ("breakdown of the peak", "params", "activations", "temp", "rule of thumb", "rule / measured",
                 "why it is off", "per module", "layer1.0", "BasicBlock", "Conv2d", "fc_model"):
        assert word in out, word


@pytest.mark.parametrize("phase", ["train", "eval"])
def test_explain_lists_each_module_once_the_measured_steps(capsys, phase):
    """The module hooks stay on for the steps after the measured one: their forwards are not listed again."""
    assert main(["explain", "--strategy", "baseline", "--batch-size", "2", "--phase", phase]) == 0
    table = capsys.readouterr().out.split("per module")[1]
    names = [line.split()[0] for line in table.splitlines()[3:] if line.startswith("    ") and line.split()]
    assert names and len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_explain_and_predict_take_the_workloads_own_batch_size(capsys, tmp_path):
    """Without --batch-size, every command uses the workload's default batch (deep_mlp's 256), as compare does."""
    small = "deep_mlp:layers=2:width=8"
    assert main(["explain", "--strategy", "baseline", "--workload", small]) == 0
    assert "train bs=256 cpu" in capsys.readouterr().out
    assert main(["predict", "--device", "cpu", "--workload", small, "--phases", "train", "--out", str(tmp_path)]) == 0
    assert pd.read_csv(next(tmp_path.glob("predict-*.csv")))["batch_size"].tolist() == [256]


def test_tracker_rounds_storages_to_blocks():
    with LiveTensorTracker(block_bytes=512) as tracker:
        a = torch.ones(1)  # 4 -> 512
        b = torch.ones(129)  # 516 -> 1024
        c = torch.empty(0)  # 0 -> 0
        assert tracker.live_bytes == 1536
    del a, b, c


def test_predict_cuda_without_gpu(capsys, tmp_path):
    assert main(["predict", "--device", "cuda", "--strategies", "baseline", "--batch-size", "2",
                 "--phases", "eval", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "assumptions" in out and "512" in out and "reserved" in out
    frame = pd.read_csv(next(tmp_path.glob("predict-*.csv")))
    predicted, workspace = int(frame.loc[0, "predicted_bytes"]), int(frame.loc[0, "cublas_workspace_bytes"])
    exact = tracked("baseline", "eval", 2)["peak_mem_bytes"]
    # the CPU-tracked peak with every storage in its allocator block (512 B or more), and cuBLAS's workspace
    assert workspace == 8_519_680  # the fc layers' addmm, in the forward's thread
    assert exact + workspace <= predicted <= (exact + workspace) * 1.005
    assert int(frame.loc[0, "predicted_reserved_bytes"]) >= predicted


def test_predict_on_meta_matches_the_cpu():
    exact = tracked("baseline", "train", 2)["peak_mem_bytes"]
    meta = fake_engine.tracked_peak(case(), "baseline", engine="meta", block_bytes=1)
    assert abs(meta - exact) <= exact * 1e-3


def test_fit_finds_the_largest_verified_batch():
    # eval: cheap steps; the search is the same for train
    low, high = tracked("baseline", "eval", 2)["peak_mem_bytes"], tracked("baseline", "eval", 3)["peak_mem_bytes"]
    assert high > low
    budget = (low + high) // 2
    [result] = fitting.fit([], budget, "eval", "cpu", WL, "synthetic", max_batch=64, time_steps=0)
    assert result.strategy == "baseline" and result.verified and result.runs >= 1
    assert result.batch_size == 2 and result.peak_bytes == low <= budget
    assert high > budget  # batch + 1 does not fit (measured above)


@pytest.mark.slow  # among the longest of make test: CI runs it in its step of long tests (.ci/run)
def test_fit_without_meta_uses_one_line_per_stage(monkeypatch):
    # Where meta cannot run a strategy (autocast), fit models each stage's peak as a line in the batch size and
    # takes the largest: at batches 2 and 3 the train peak is Adam's step, by batch 5 it is the backward.
    monkeypatch.setattr(fitting, "_probe_peak", lambda case, spec: None)
    four, five = tracked("baseline", "train", 4)["peak_mem_bytes"], tracked("baseline", "train", 5)["peak_mem_bytes"]
    budget = (four + five) // 2
    result = fitting.fit_cpu("baseline", budget, "train", WL, "synthetic", max_batch=64, low=2, high=3)
    assert result.verified and result.batch_size == 4 and result.peak_bytes == four <= budget
    assert result.next_batch_method in ("measured", "per-stage linear model from the measured batch")
    assert result.next_batch_peak_bytes > budget


def test_fit_cli_table(capsys, tmp_path, monkeypatch):
    calls = []

    def fake_fit(specs, budget, *args, **kwargs):
        calls.append((specs, budget))
        return [fitting.FitResult("baseline", "train", "cpu", budget, 7, 1000, True, 2000, "meta probe", 1.5, "", 1)]

    monkeypatch.setattr(fitting, "fit", fake_fit)
    assert main(["fit", "--budget", "300MiB", "--device", "cpu", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "largest batch" in out and "verified by a tracked run" in out
    assert calls == [([], 300 * 2**20)]
    frame = pd.read_csv(next(tmp_path.glob("fit-*.csv")))
    assert frame.loc[0, "batch_size"] == 7
    assert list(frame.columns) == FIT.names and (frame["schema_version"] == FIT_SCHEMA_VERSION).all()


def test_fit_where_even_batch_1_is_over_the_budget_runs_no_real_step():
    """The fake count says batch 1 does not fit, so no real step is run to say it again (at full size
    that step would hold the real model)."""
    result = fitting.fit_cpu("baseline", 2**10, "train", "deep_mlp:layers=4:width=16", "synthetic", 64)
    assert result.batch_size == 0 and result.runs == 0
    assert result.next_batch_method == "fake probe" and result.next_batch_peak_bytes > 2**10


def test_fit_rows_are_rows_of_the_fit_table_and_an_out_of_memory_peak_is_empty():
    import dataclasses
    import math

    from bench.core.schema import Row

    out_of_memory = fitting.FitResult("pitfall", "train", "cpu", 2**20, 0, None, False, math.inf, "measured", None,
                                      "even batch 1 exceeds the budget", 1)
    [row] = fitting.fit_rows([out_of_memory])
    assert isinstance(row, Row) and row.table is FIT and row["schema_version"] == FIT_SCHEMA_VERSION
    assert row["next_batch_peak_bytes"] is None and row["budget_bytes"] == 2**20
    # every field of FitResult is a declared column, and every declared column is a field (or the version)
    assert [f.name for f in dataclasses.fields(fitting.FitResult)] == [c for c in FIT.names if c != "schema_version"]


@pytest.mark.parametrize("argv", [
    ["fit", "--budget", "lots"],
    ["fit", "--budget", "1GiB", "--strategies", "no_such_strategy"],
    ["predict", "--strategies", "no_such_strategy"],
    ["explain", "--strategy", "no_such_strategy", "--batch-size", "2"],
    ["explain", "--strategy", "baseline", "--device", "gpu"],
    ["fit", "--budget", "1GiB", "--device", "tpu"],
])
def test_cli_errors_exit_2_with_one_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_memory_limit_on_cpu_warns_and_does_nothing(capsys):
    from bench.cli.commands_run import apply_memory_limit

    assert apply_memory_limit("2GiB", "cpu") is None
    assert "no effect" in capsys.readouterr().err
    with pytest.raises(UsageError):
        apply_memory_limit("lots", "cpu")


# --- CUDA (skipped without a GPU) -----------------------------------------------------------------------

# predict against the GPU, every strategy at two batch sizes: tests/test_cuda_prediction.py


@pytest.mark.cuda
def test_oom_releases_cuda_memory(temporary_strategy=None):
    from strategies import Strategy, register_strategy

    class Hog(Strategy):
        name = "test_cuda_hog"

        def end_step(self, kept):
            kept["hog"] = torch.empty(2**50, dtype=torch.uint8, device="cuda")  # far beyond any GPU: OOM

    register_strategy(Hog)
    try:
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        row = run_case(case("test_cuda_hog", device="cuda"))
        assert row["status"] == "oom", row
        assert torch.cuda.memory_allocated() == before
    finally:
        STRATEGIES.unregister("test_cuda_hog")


def test_explain_lists_the_units_a_plan_recomputes(capsys):
    assert main(["explain", "--workload", "deep_mlp:layers=6:width=8", "--strategy", "checkpoint:segments=3",
                 "--batch-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "checkpointing plan (checkpoint)" in out and "4 of 6 units recomputed in backward" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[-8:] if line.strip()[:1].isdigit()}
    # each Linear(8, 8) keeps its 64 x 8 float32 output: 2.0 KiB, which checkpointing units 0-3 saves
    assert rows["0"][2] == "0-1" and rows["3"][2] == "2-3" and rows["5"][2] == "-"
    assert " ".join(rows["0"][-4:]) == "2.0 KiB 2.0 KiB" and rows["5"][-1] == "-"
