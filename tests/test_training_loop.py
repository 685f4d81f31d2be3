"""Gradients, optimizer state and the training loop: accumulation, the step in backward, optimizer choices,
kept gradients, the CUDA-only loop habits, and the articles' pitfalls measured.

Small cases (deep_mlp and gpt_mini at small widths, captcha_resnet18 at batch 2 or 4) on the exact CPU tracker;
figures quoted were measured here (torch 2.13 CPU).
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from bench.cli.console import format_table
from bench.core.errors import UsageError
from bench.core.results import to_frame
from bench.measure import memory
from bench.report.markdown import pitfall_table
from bench.run.case import Case, bind_case
from bench.run.runner import Session, memory_pass, release_cuda_memory, run_case, verify
from strategies import STRATEGIES, Strategy, StrategySpec, parse_strategy
from workloads import get_workload

MLP = "deep_mlp:layers=24:width=8"
GPT = "gpt_mini:layers=2:width=32:heads=2:seq_len=16"


def _case(workload: str, strategy: str, phase: str = "train", batch: int = 8) -> Case:
    return Case(workload, strategy, phase, batch, "cpu", data="synthetic", warmup=0, steps=1)


def _row(workload: str, strategy: str, phase: str = "train", batch: int = 8) -> dict:
    return run_case(_case(workload, strategy, phase, batch), env={})


def _verified(workload: str, strategy: str, batch: int) -> dict:
    case = _case(workload, strategy, "train", batch)
    return verify(case, bind_case(case)[0])


def _memory(workload: str, strategy: str, phase: str = "train", batch: int = 8) -> dict:
    case = _case(workload, strategy, phase, batch)
    strategy, context = bind_case(case)
    strategy.check(context)
    return memory_pass(case, strategy)


# --- grad_accumulation ------------------------------------------------------------------------------------

@pytest.mark.parametrize("workload", [MLP, GPT + ":dropout=0"])
def test_grad_accumulation_matches_without_batchnorm_or_dropout(workload):
    row = _row(workload, "grad_accumulation:micro_batches=4")
    assert row["status"] == "ok" and row["matches_baseline"] is True and row["message"] == "", row
    assert 0 < row["max_grad_rel_diff"] < 1e-4, row  # the same sums in another order: close, not equal


def test_grad_accumulation_says_why_it_differs_with_dropout_and_batchnorm():
    gpt = _verified(GPT, "grad_accumulation", batch=4)
    assert gpt["matches_baseline"] is False and "dropout draws its masks per micro-batch" in gpt["message"], gpt
    captcha = _verified("captcha_resnet18", "grad_accumulation:micro_batches=2", batch=2)
    assert captcha["matches_baseline"] is False and captcha["bn_stats_match"] is False, captcha
    assert "BatchNorm normalises each of the 2 micro-batches" in captcha["message"], captcha


def test_grad_accumulation_holds_one_micro_batch_of_activations():
    # deep_mlp:layers=24:width=8 at batch 256: peak activations 212,992 -> 53,248 bytes with 4 micro-batches
    whole, split = _memory(MLP, "baseline", batch=256), _memory(MLP, "grad_accumulation:micro_batches=4", batch=256)
    assert split["peak_activations_bytes"] * 3 < whole["peak_activations_bytes"]
    assert split["peak_mem_bytes"] < whole["peak_mem_bytes"]


def test_grad_accumulation_batch_that_does_not_divide_is_an_unsupported_row():
    row = _row(MLP, "grad_accumulation:micro_batches=3", batch=8)
    assert row["status"] == "unsupported"
    assert "micro_batches=3 needs a batch size divisible by 3, not 8" in row["message"]
    with pytest.raises(UsageError, match="micro_batches=0 must be at least 1"):
        parse_strategy("grad_accumulation:micro_batches=0")


# --- optimizer_in_backward --------------------------------------------------------------------------------

def test_optimizer_in_backward_matches_and_holds_no_gradient():
    # (on the captcha model, where the peak is in backward, it lowers the peak: tests/test_strategies.py)
    row = _row(MLP, "optimizer_in_backward")
    assert row["matches_baseline"] is True and row["max_param_rel_diff"] == 0.0, row
    largest = max(p.numel() * p.element_size() for p in get_workload(MLP).build_model().parameters())
    assert row["peak_grads_bytes"] <= largest < _memory(MLP, "baseline")["peak_grads_bytes"]


def test_optimizer_in_backward_composes_with_bf16_weights():
    # torchtune's full fine-tune recipe with optimizer_in_bwd and bfloat16 weights: each bf16 parameter gets its own
    # AdamW step in backward; the update is the one bf16_weights alone makes (the same per-parameter arithmetic, to
    # the bit), and at the peak at most one bf16 gradient is alive where bf16_weights alone holds all of them
    def one_step(spec):
        case = _case(MLP, spec)
        session = Session(case, bind_case(case)[0])
        session.step()
        return [p.detach().clone() for p in session.base_model.parameters()]

    for alone, early in zip(one_step("bf16_weights"), one_step("optimizer_in_backward+bf16_weights")):
        assert early.dtype == torch.bfloat16 and torch.equal(early, alone)
    largest = max(p.numel() * 2 for p in get_workload(MLP).build_model().parameters())
    together, alone = _memory(MLP, "optimizer_in_backward+bf16_weights"), _memory(MLP, "bf16_weights")
    assert together["peak_grads_bytes"] <= largest < alone["peak_grads_bytes"], (together, alone)
    assert together["peak_optimizer_bytes"] == alone["peak_optimizer_bytes"]  # the same bf16 AdamW state


def test_optimizer_in_backward_refuses_what_needs_every_gradient_at_once():
    for other in ("amp", "grad_accumulation", "keep_grads"):
        with pytest.raises(UsageError, match="cannot be combined"):
            parse_strategy(f"optimizer_in_backward+{other}")


def test_a_step_that_never_happens_is_caught(temporary_strategy):
    """Verification takes one optimizer step: a strategy that computes the gradients but skips the step fails."""
    @temporary_strategy
    class SkipsStep(Strategy):
        name = "test_skips_step"

        def optimizer_step(self, optimizer):
            pass

    row = _row(MLP, "test_skips_step")
    assert row["max_grad_rel_diff"] == 0.0 and row["max_param_rel_diff"] > 0 and row["matches_baseline"] is False


# --- optimizer --------------------------------------------------------------------------------------------

def test_optimizer_implementations_match_and_foreach_costs_temporaries():
    rows = {impl: _row(MLP, f"optimizer:impl={impl}") for impl in ("for_loop", "foreach", "fused")}
    for impl, row in rows.items():
        assert row["matches_baseline"] is True, row
        assert f"optimizer.name=Adam;optimizer.impl={impl}" in row["strategy_settings"]
    # deep_mlp at batch 8: for_loop 29,920 bytes (= baseline), foreach 36,288: its temporaries span all parameters
    assert rows["foreach"]["peak_mem_bytes"] > rows["for_loop"]["peak_mem_bytes"]
    assert "optimizer.impl=for_loop" in _row(MLP, "optimizer")["strategy_settings"]  # PyTorch's CPU choice


def test_another_optimizer_says_it_differs_and_shows_its_state():
    adam = _memory(MLP, "baseline")["peak_optimizer_bytes"]
    sgd, adafactor = _row(MLP, "optimizer:name=sgd"), _row(MLP, "optimizer:name=adafactor")
    for row, name in ((sgd, "SGD"), (adafactor, "Adafactor")):
        assert row["status"] == "ok" and row["matches_baseline"] is False, row
        assert f"{name} replaces the workload's Adam" in row["message"]
        assert row["max_grad_rel_diff"] == 0.0  # the same gradients; the update differs
    assert sgd["peak_optimizer_bytes"] == 0 < adafactor["peak_optimizer_bytes"] < adam
    same = _row(GPT, "optimizer:name=adamw", batch=2)  # gpt_mini's own optimizer: nothing changes
    assert same["matches_baseline"] is True and same["message"] == "", same


def test_optimizer_bad_choices():
    with pytest.raises(UsageError, match="optimizer:name='lion'; valid choices: workload, sgd, adam, adamw"):
        parse_strategy("optimizer:name=lion")
    with pytest.raises(UsageError, match="optimizer:impl='fast'; valid choices: default, foreach, for_loop, fused"):
        parse_strategy("optimizer:impl=fast")
    row = _row(MLP, "optimizer:name=adafactor:impl=fused")
    assert row["status"] == "unsupported" and "Adafactor has no fused implementation" in row["message"]


# --- keep_grads -------------------------------------------------------------------------------------------

def test_keep_grads_keeps_every_gradient_between_steps():
    base, kept = _memory(MLP, "baseline"), _memory(MLP, "keep_grads")
    assert kept["peak_mem_bytes"] > base["peak_mem_bytes"]
    assert _row(MLP, "keep_grads")["matches_baseline"] is True
    session = Session(_case(MLP, "keep_grads"), parse_strategy("keep_grads"))
    session.step()
    assert all(p.grad is not None and not p.grad.any() for p in session.parameters())


# --- pitfalls ---------------------------------------------------------------------------------------------

def test_pitfall_loss_sum_grows_by_one_forward_per_step_in_eval():
    """The captcha model's validation loop with `total += loss`: every batch's graph stays alive."""
    case = _case("captcha_resnet18", "pitfall_loss_sum", "eval", 2)
    session = Session(case, bind_case(case)[0])
    tracker = memory.LiveTensorTracker("cpu")
    with tracker:
        tracker.track(session.parameters(), "params")
        ends = []
        for _ in range(4):
            session.step()
            ends.append(tracker.live_bytes)
    growth = [b - a for a, b in zip(ends, ends[1:])]
    assert growth[0] > 1_000_000 and len(set(growth)) == 1, growth  # the same every step, for ever
    assert _memory("captcha_resnet18", "pitfall_loss_sum", "eval", 2)["mem_growth_bytes_per_step"] == growth[0]
    # in training, backward has freed the saved tensors: only autograd's nodes (host memory, not tensors) remain
    assert _memory(MLP, "pitfall_loss_sum")["mem_growth_bytes_per_step"] == 0


def test_pitfall_retain_graph_keeps_the_saved_activations():
    base, retained = _memory(MLP, "baseline"), _memory(MLP, "pitfall_retain_graph")
    assert retained["peak_mem_bytes"] > base["peak_mem_bytes"]
    assert retained["peak_activations_bytes"] > base["peak_activations_bytes"]
    assert _row(MLP, "pitfall_retain_graph")["matches_baseline"] is True


def test_pitfalls_are_named_and_listed_apart():
    pitfalls = [name for name in STRATEGIES.names() if parse_strategy(name).pitfall]
    assert pitfalls == [name for name in STRATEGIES.names() if name.startswith("pitfall_")]
    assert set(pitfalls) >= {"pitfall_loss_sum", "pitfall_retain_graph"}
    assert StrategySpec("checkpoint+pitfall_retain_graph").role == "pitfall"
    assert parse_strategy("checkpoint+pitfall_loss_sum").pitfall
    assert StrategySpec("baseline").role == "baseline" and StrategySpec("checkpoint+amp").role == "technique"


def _rows_for_tables() -> pd.DataFrame:
    common = {"workload": "deep_mlp", "data": "synthetic", "device": "cpu", "batch_size": 8, "status": "ok",
              "message": "", "matches_baseline": True, "step_time_ms_median": 1.0}
    # the role a run writes into each row, from the strategy's declaration
    rows = [{**common, "strategy": s, "strategy_role": StrategySpec(s).role, "phase": p, "peak_mem_bytes": peak,
             "mem_growth_bytes_per_step": growth}
            for s, p, peak, growth in [("baseline", "train", 100, 0), ("baseline", "eval", 80, 0),
                                       ("checkpoint", "train", 90, 0), ("pitfall_loss_sum", "eval", 90, 4096),
                                       ("pitfall_retain_graph", "train", 150, 0)]]
    return to_frame(rows)


def test_console_table_lists_pitfalls_apart():
    text = format_table(_rows_for_tables())
    techniques, pitfalls = text.split("pitfalls (")
    assert "checkpoint" in techniques and "pitfall_" not in techniques
    assert "pitfall_loss_sum" in pitfalls and "pitfall_retain_graph" in pitfalls and "checkpoint" not in pitfalls
    assert "growth 4,096 B/step" in pitfalls
    assert [line.split()[:2] for line in pitfalls.splitlines() if line.startswith("baseline")] == [["baseline", "eval"]]


def test_report_lists_pitfalls_apart_and_names_the_eval_baseline():
    frame = _rows_for_tables()
    order = list(dict.fromkeys(frame["strategy"]))
    eval_table = "\n".join(pitfall_table(frame[frame["phase"] == "eval"], order))
    assert "`baseline`" in eval_table and "no_grad_eval" in eval_table and "| 4,096 |" in eval_table
    train_table = "\n".join(pitfall_table(frame[frame["phase"] == "train"], order))
    assert "`pitfall_retain_graph`" in train_table and "`baseline`" not in train_table
    assert "`checkpoint`" not in train_table


def test_cli_list_puts_pitfalls_apart(capsys):
    from bench.cli.main import main

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    techniques, pitfalls = out.split("\npitfalls")
    assert "optimizer_in_backward" in techniques and "pitfall_" not in techniques
    assert "pitfall_loss_sum" in pitfalls and "pitfall_retain_graph" in pitfalls


# --- CUDA only --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["empty_cache", "pinned_loader"])
def test_cuda_only_habits_are_unsupported_on_the_cpu(name):
    row = _row(MLP, name)
    assert row["status"] == "unsupported" and "needs device cuda" in row["message"]


@pytest.mark.cuda
@pytest.mark.parametrize("spec", ["empty_cache", "pinned_loader", "pinned_loader:pin_memory=false"])
def test_cuda_loop_habits_match(spec):
    row = run_case(Case(MLP, spec, "train", 8, "cuda", data="synthetic", warmup=1, steps=3))
    assert row["status"] == "ok" and row["matches_baseline"] is True, row


@pytest.mark.cuda
def test_between_cases_nothing_stays_allocated_not_even_cublas_workspaces():
    """A train step leaves cuBLAS a workspace per thread that ran a matrix product (the forward's and autograd's),
    allocated for the life of the process; release_cuda_memory frees them, so the next case measures its own. On
    the H200 an eval case measured after train cases then equalled a fresh process's to the byte (91,318,272 B for
    captcha's no_grad_eval at batch 8; 124,872,704 B before)."""
    release_cuda_memory()
    before = torch.cuda.memory_allocated()  # what other tests of this process may still hold
    case = Case("captcha_resnet18", "baseline", "train", 8, "cuda", data="synthetic", warmup=0, steps=1)
    session = Session(case, bind_case(case)[0])
    session.step()
    del session
    release_cuda_memory()
    assert torch.cuda.memory_allocated() == before


@pytest.mark.cuda
def test_empty_cache_lowers_reserved_memory_between_steps():
    """After a step with empty_cache every cached segment holds a live block: the allocator gave back every segment
    it could. Free space inside a segment with a live block stays reserved (an H200 kept 57 MiB of it after one step
    of captcha at batch 8), so reserved is not allocated; it is below the same step's without empty_cache."""
    reserved = {}
    for spec in ("baseline", "empty_cache"):
        release_cuda_memory()
        case = Case("captcha_resnet18", spec, "train", 8, "cuda", data="synthetic", warmup=0, steps=1)
        session = Session(case, bind_case(case)[0])
        session.step()
        reserved[spec] = torch.cuda.memory_reserved()
        if spec == "empty_cache":
            segments = torch.cuda.memory_snapshot()
            assert all(any(block["state"] == "active_allocated" for block in segment["blocks"])
                       for segment in segments), [s["total_size"] for s in segments]
        del session
    assert reserved["empty_cache"] < reserved["baseline"]
