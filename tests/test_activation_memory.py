"""Activation memory beyond plain checkpointing: sqrt(N) segments, budget plans, selective checkpointing, offload,
torch.compile's activation memory budget. Tiny workloads; figures quoted were measured here (torch 2.13 CPU)."""

from __future__ import annotations

import pytest
import torch

from bench.core.errors import UsageError
from bench.run.case import Case, bind_case
from bench.run.runner import CaseMeter, allocator_memory_pass, memory_pass, run_case, timing_pass, verify
from bench.run.training_state import training_state_bytes
from strategies import parse_strategy
from strategies.checkpoint import (candidate_plans, every_unit_plan, format_plan, parse_budget, segment_plan,
                                   sqrt_segments)
from strategies.offload import HostBytes, counted_save_on_cpu

MLP = "deep_mlp:layers=24:width=8"


def _case(workload: str, strategy: str, batch: int, phase: str = "train") -> Case:
    return Case(workload, strategy, phase, batch, "cpu", data="synthetic", warmup=0, steps=1)


def _activation_bytes(strategy: str, layers: int) -> int:
    """The peak less what no activation technique can remove: weights, gradients, optimizer state and batch."""
    case = _case(f"deep_mlp:layers={layers}:width=8", strategy, 256)
    m = memory_pass(case, bind_case(case)[0])
    return (m["peak_mem_bytes"] - m["peak_params_bytes"] - m["peak_grads_bytes"] - m["peak_optimizer_bytes"]
            - m["peak_batch_bytes"])


# --- checkpoint:segments=sqrt -------------------------------------------------------------------------------

def test_sqrt_segments_activation_memory_grows_like_sqrt_n():
    # Measured at batch 256, width 8 (one layer's activation = 8,192 B), peak less weights, gradients, Adam state
    # and batch: baseline 98,596 / 319,780 / 1,204,516 B at N = 9 / 36 / 144 (+8,192 B per layer),
    # segments=sqrt 65,828 / 114,980 / 213,284 B (+16,384 B per unit of sqrt(N)): the increments from N = 9 to
    # 36 to 144 grow 4x for the baseline (like N) and 2x for sqrt (like sqrt(N)).
    layers = (9, 36, 144)
    activation = {}
    for strategy, expected_growth in (("baseline", 4.0), ("checkpoint:segments=sqrt", 2.0)):
        small, middle, large = activation[strategy] = tuple(_activation_bytes(strategy, n) for n in layers)
        growth = (large - middle) / (middle - small)
        assert growth == pytest.approx(expected_growth, rel=0.1), (strategy, small, middle, large)
    assert activation["checkpoint:segments=sqrt"][-1] < activation["baseline"][-1] / 5


def test_sqrt_segments_resolve_to_the_rounded_square_root():
    assert [sqrt_segments(n) for n in (1, 2, 10, 16, 24, 1000)] == [1, 1, 3, 4, 5, 32]
    row = run_case(_case(MLP, "checkpoint:segments=sqrt", 8), env={})
    assert row["status"] == "ok" and row["matches_baseline"] is True, row
    assert "checkpoint.segments=5" in row["strategy_settings"] and "checkpoint.plan=0-3 4-7 8-11 12-15" in \
        row["strategy_settings"], row["strategy_settings"]


# --- checkpoint:segments=all ---------------------------------------------------------------------------------

def test_segments_all_checkpoints_every_unit_the_last_included():
    # segments=N leaves its last segment (one unit) unchecked; `all` checkpoints that one too, one unit per
    # checkpoint even where units chain (deep_mlp's 4 Linear layers do). Its memory against transformers' own
    # checkpointing: tests/test_loop_lifetimes.py.
    assert every_unit_plan(3) == ((0,), (1,), (2,)) and segment_plan(3, 3, True) == ((0,), (1,))
    row = run_case(_case("deep_mlp:layers=4:width=8", "checkpoint:segments=all", 8), env={})
    assert row["status"] == "ok" and row["matches_baseline"] is True, row
    settings = dict(part.split("=", 1) for part in row["strategy_settings"].split(";"))
    assert settings["checkpoint.segments"] == "all" and settings["checkpoint.plan"] == "0 1 2 3"
    assert row["recompute_plan"] == "0 1 2 3"
    with pytest.raises(UsageError, match="sqrt, auto or all"):
        parse_strategy("checkpoint:segments=every")
    with pytest.raises(UsageError, match="not both"):
        parse_strategy("checkpoint:segments=all:budget=0.5")
    assert every_unit_plan(4) == candidate_plans(4, chain=True)[-1]  # the budget search's last resort


# --- checkpoint:budget ---------------------------------------------------------------------------------------

def test_candidate_plans_hold_every_segmentation_and_its_prefixes():
    plans = candidate_plans(4, chain=True)
    assert plans[0] == ()  # nothing recomputed
    assert segment_plan(4, 2, True) == ((0, 1),) and segment_plan(4, 4, True) == ((0,), (1,), (2,))
    assert {((0,),), ((0,), (1,)), ((0,), (1,), (2,)), ((0, 1),)} <= set(plans)
    assert len(plans) == len(set(plans))
    assert segment_plan(6, 3, chain=False) == ((0,), (1,), (2,), (3,))  # units that do not chain: one by one
    assert format_plan(((0, 1), (2,))) == "0-1 2" and format_plan(()) == "none"


def test_budget_parses_a_fraction_or_a_size():
    assert parse_budget("0.6") == (0.6, None)
    assert parse_budget("300MiB") == (None, 300 * 2**20)
    for bad in ("0", "abc", "-1"):
        with pytest.raises(UsageError, match="checkpoint:budget"):
            parse_strategy(f"checkpoint:budget={bad}")
    with pytest.raises(UsageError, match="not both"):
        parse_strategy("checkpoint:segments=3:budget=0.5")


def test_unit_flops_are_the_matmuls_of_each_unit():
    # Linear(8, 8) on a batch of 8: addmm of 8x8 by 8x8, 2 * 8 * 8 * 8 FLOPs per layer.
    assert CaseMeter(_case(MLP, "baseline", 8)).unit_flops() == [2 * 8 * 8 * 8] * 24


def test_budget_row_fits_records_its_plan_and_matches():
    # Batch 256: activations (196,608 B) dwarf weights, gradients and Adam state (27,648 B), so 0.6 is reachable.
    # Measured: baseline 275,172 B; budget=0.6 -> plan 0-7 8-15, 160,484 B measured, 143,916 B predicted on meta
    # (meta's count of this MLP misses two of its 8,192-byte activations: hence the confirming measured step).
    baseline = run_case(_case(MLP, "baseline", 256), env={})
    row = run_case(_case(MLP, "checkpoint:budget=0.6", 256), env={})
    assert row["status"] == "ok" and row["matches_baseline"] is True, row
    assert row["peak_mem_bytes"] <= 0.6 * baseline["peak_mem_bytes"]
    assert abs(row["predicted_peak_bytes"] - row["peak_mem_bytes"]) <= 0.15 * row["peak_mem_bytes"]
    settings = dict(part.split("=", 1) for part in row["strategy_settings"].split(";"))
    assert settings["checkpoint.plan"] not in ("", "none")
    assert int(settings["checkpoint.budget_bytes"]) == int(0.6 * baseline["peak_mem_bytes"])
    # the least recompute: a looser budget recomputes fewer FLOPs, a budget of the whole peak nothing
    loose = run_case(_case(MLP, "checkpoint:budget=0.9", 256), env={})
    loose_settings = dict(part.split("=", 1) for part in loose["strategy_settings"].split(";"))
    assert int(loose_settings["checkpoint.recompute_flops"]) < int(settings["checkpoint.recompute_flops"])
    whole = run_case(_case(MLP, "checkpoint:budget=1", 256), env={})
    assert "checkpoint.plan=none" in whole["strategy_settings"] and whole["peak_mem_bytes"] == baseline["peak_mem_bytes"]


def test_a_budget_no_plan_meets_is_unsupported_with_the_smallest_peak():
    # one byte over the parameters and optimizer state: every plan holds those, its gradients and activations besides
    budget = training_state_bytes(MLP) + 1
    row = run_case(_case(MLP, f"checkpoint:budget={budget}B", 256), env={})
    assert row["status"] == "unsupported", row
    assert "no plan of" in row["message"] and "smallest peak reachable is" in row["message"], row["message"]


def test_a_budget_under_the_parameters_and_optimizer_state_predicts_no_plan(monkeypatch):
    """Every plan's step holds the parameters and optimizer state whatever it recomputes: a budget under them is
    refused before any plan is predicted (each a full trace: llama-3.1-70b's 19 were a minute of its plan), where the
    strategies keep that state; one that does not (bf16_weights) is searched as before."""
    predicted = []
    monkeypatch.setattr(CaseMeter, "predicted_peak", lambda meter, strategy: predicted.append(strategy) or 1)
    floor = training_state_bytes(MLP)
    row = run_case(_case(MLP, f"checkpoint:budget={floor - 1}B", 256), env={})
    assert row["status"] == "unsupported" and not predicted, row
    assert "no plan can fit" in row["message"] and "parameters and optimizer state" in row["message"], row["message"]
    case = _case(MLP, f"checkpoint:budget={floor - 1}B+bf16_weights", 256)
    strategy = bind_case(case)[0]
    assert CaseMeter(case).state_floor(strategy) is None
    assert CaseMeter(case).state_floor(bind_case(_case(MLP, "checkpoint", 256))[0]) == floor


# --- selective_checkpoint ------------------------------------------------------------------------------------

GPT = "gpt_mini:layers=2:width=32:heads=2:seq_len=32"


def test_selective_policies_trade_memory_for_recompute():
    # gpt_mini batch 8 at seq_len 32: saving the matmul and attention outputs keeps more than recomputing
    # everything, and less than the baseline, which also keeps what LayerNorm, GELU and dropout save.
    peaks = {}
    for spec in ("baseline", "selective_checkpoint", "selective_checkpoint:policy=none"):
        peaks[spec] = memory_pass(_case(GPT, spec, 8), bind_case(_case(GPT, spec, 8))[0])["peak_mem_bytes"]
    assert peaks["selective_checkpoint:policy=none"] < peaks["selective_checkpoint"] < peaks["baseline"], peaks


def test_selective_checkpoint_survives_the_in_place_residual_add():
    """The captcha ResNet's `tmp += self.identity(x)` mutates the second BatchNorm's output: the default policy
    saves only convolution outputs, so it runs and matches; a policy that saved BatchNorm outputs hits PyTorch's
    mutation check, and that is an error row, not a crashed sweep."""
    case = _case("captcha_resnet18", "selective_checkpoint", 2)
    assert verify(case, bind_case(case)[0])["matches_baseline"] is True


def test_a_policy_that_saves_a_mutated_output_is_an_error_row(monkeypatch):
    import strategies.selective_checkpoint as selective

    saves_batchnorm = selective.POLICIES["compute"] | {torch.ops.aten.native_batch_norm.default,
                                                       torch.ops.aten._native_batch_norm_legit.default,
                                                       torch.ops.aten._native_batch_norm_legit_functional.default}
    monkeypatch.setitem(selective.POLICIES, "batchnorm", saves_batchnorm)
    row = run_case(_case("captcha_resnet18", "selective_checkpoint:policy=batchnorm", 2), env={})
    assert row["status"] == "error" and "mutated" in row["message"], row


def test_selective_checkpoint_bad_policy_is_a_usage_error():
    with pytest.raises(UsageError, match="valid choices: compute, matmul, none"):
        parse_strategy("selective_checkpoint:policy=everything")


# --- offload -------------------------------------------------------------------------------------------------

def test_offload_counts_the_host_copies_of_saved_tensors():
    host = HostBytes()
    x = torch.randn(64, 32, requires_grad=True)
    with counted_save_on_cpu(host, pin_memory=False):
        y = (x * x).sum()  # mul saves both operands: two host copies of x
    assert host.peak_bytes == 2 * x.numel() * 4
    y.backward()
    del y
    assert host.live_bytes == 0


def test_offload_is_unsupported_on_the_cpu():
    row = run_case(_case(MLP, "offload", 8), env={})
    assert row["status"] == "unsupported" and "cuda" in row["message"], row


# --- compile:budget ------------------------------------------------------------------------------------------

def test_compile_plumbing_with_the_eager_partition_backend():
    """Verification and timing of a compiled step on the CPU with aot_eager_decomp_partition (no C++ compiler);
    compilation falls in the warm-up step and is its own column."""
    case = Case("deep_mlp:layers=4:width=8", "compile:budget=0.5:backend=aot_eager_decomp_partition", "train", 8,
                "cpu", data="synthetic", warmup=1, steps=2)
    strategy = bind_case(case)[0]
    assert verify(case, strategy)["matches_baseline"] is True
    timing = timing_pass(case, strategy)
    assert strategy.columns()["compile_time_ms"] > timing["step_time_ms_median"]


GPT = "gpt_mini:layers=2:width=64:heads=2:seq_len=64"  # attention, GELU, LayerNorm: cheap ops the partitioner recomputes


def test_the_allocator_count_agrees_with_the_tracker():
    """The CPU count for compiled steps (torch.profiler's allocator events) against the exact tracker, on an eager
    step both can see: 10,782,332 bytes each at batch 8 (torch 2.13 CPU), the peak in backward."""
    case = _case(GPT, "baseline", 8)
    tracked = memory_pass(case, bind_case(case)[0])
    counted = allocator_memory_pass(case, bind_case(case)[0])
    assert counted["memory_method"] == "cpu_allocator_events" and counted["peak_stage"] == tracked["peak_stage"]
    assert abs(counted["peak_mem_bytes"] - tracked["peak_mem_bytes"]) <= 0.005 * tracked["peak_mem_bytes"]
    assert counted["mem_growth_bytes_per_step"] == 0


def test_compile_budget_lowers_the_cpu_peak_counted_at_the_allocator():
    """The partitioner's budget, measured on the compiled step on the CPU (eager partition backend: the same
    partition without compiling C++). Measured at batch 8: baseline 10,782,332; budget 1.0 9,919,100;
    budget 0.1 7,886,992 (-20%; inductor: 9,919,100 and 7,760,820)."""
    peaks = {}
    for budget in (1.0, 0.1):
        spec = f"compile:budget={budget}:backend=aot_eager_decomp_partition"
        case = _case(GPT, spec, 8)
        memory = memory_pass(case, bind_case(case)[0])
        assert memory["memory_method"] == "cpu_allocator_events"
        peaks[budget] = memory["peak_mem_bytes"]
    assert peaks[0.1] <= 0.85 * peaks[1.0], peaks


def test_compile_without_a_cpu_compiler_is_unsupported_with_the_reason(monkeypatch):
    from strategies import compile as compile_strategy

    with torch._inductor.config.patch({"cpp.cxx": ("membench-no-such-c++",)}):
        assert compile_strategy.cpu_compiler() is None
    monkeypatch.setattr(compile_strategy, "cpu_compiler", lambda: None)
    row = run_case(_case(MLP, "compile:budget=0.5", 8), env={})
    assert row["status"] == "unsupported" and "no C++ compiler" in row["message"], row
    assert run_case(_case(MLP, "compile:budget=0.5:backend=aot_eager_decomp_partition", 8),
                    env={})["status"] == "ok"
    with pytest.raises(UsageError):
        parse_strategy("compile:budget=0")
    with pytest.raises(UsageError, match="valid choices: inductor"):
        parse_strategy("compile:backend=eager")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_offload_and_compile():
    """Without dropout: on CUDA compiled dropout draws its masks from another random stream than eager dropout, so
    with it compile differs from the baseline by design (an H200 said so in the row: gradient rel diff 0.83)."""
    rows = {spec: run_case(Case("gpt_mini:layers=2:width=64:heads=2:seq_len=64:dropout=0", spec, "train", 8, "cuda",
                                data="synthetic", warmup=1, steps=2))
            for spec in ("baseline", "offload", "compile:budget=1.0", "compile:budget=0.1")}
    for spec, row in rows.items():
        assert row["status"] == "ok" and row["matches_baseline"], row
    assert rows["offload"]["offload_host_peak_bytes"] > 0
    assert rows["offload"]["peak_mem_bytes"] < rows["baseline"]["peak_mem_bytes"]
    assert rows["compile:budget=1.0"]["compile_time_ms"] > 0
    assert rows["compile:budget=0.1"]["peak_mem_bytes"] <= rows["compile:budget=1.0"]["peak_mem_bytes"]


def test_a_budget_in_eval_is_unsupported_without_planning():
    row = run_case(_case(MLP, "checkpoint:budget=0.6", 8, phase="eval"), env={})
    assert row["status"] == "unsupported" and "no backward" in row["message"], row


def test_fit_says_a_budget_plan_is_chosen_per_case(capsys, tmp_path):
    from bench.cli.main import main

    assert main(["fit", "--budget", "100KiB", "--workload", "deep_mlp:layers=4:width=8", "--strategies",
                 "checkpoint:budget=0.5", "--max-batch", "8", "--time-steps", "0", "--out", str(tmp_path)]) == 0
    assert "unsupported: checkpoint:budget chooses its plan per case" in capsys.readouterr().out
