"""The baseline's peak is a literal training loop's peak, to the byte, on every built-in workload.

The loop is the handful of lines a user writes (`pred = model(x); loss = criterion(pred, y); loss.backward();
optimizer.step(); optimizer.zero_grad()`), built from the workload's model, optimizer and batch exactly as
membench's Session builds them (same seeds), and counted by PyTorch's own MemTracker
(`torch.distributed._tools.mem_tracker`); membench's figure is the baseline's memory pass (`peak_mem_bytes`).

Both count the same things, so no allowance is made: the bytes of every live tensor storage on the CPU (a storage
once, whatever its views), the parameters, buffers, gradients, the optimizer's state, and the batch held where
the model reads it (on the CPU the host batch *is* the device batch: one storage, counted once by each).
MemTracker registers the storages of operator outputs and those given to `track_external`; membench's tracker
also registers a storage first seen as an operator's input, which the loop has none of here.
"""

from __future__ import annotations

import gc
import weakref

import pytest

import conformance
from bench.run.case import Case, bind_case
from bench.run.runner import Session
from conformance import MEASURED_STEP, literal_loop_peak, membench_peak
from workloads import WORKLOADS, workload_names

pytest.importorskip("torch.distributed._tools.mem_tracker")

# each workload runs at its class's `small_for["loop"]` size, else `small` (a registered workload without one
# fails the suite: tests/test_workloads.py)
LOOP_MLP = WORKLOADS.get("deep_mlp").small_case("loop")  # batch 64: the peak falls in backward


@pytest.mark.parametrize("workload", workload_names())
def test_train_peak_is_the_literal_loops_to_the_byte(workload):
    conformance.check_train_peak_is_the_literal_loops(workload)


@pytest.mark.parametrize("workload", [pytest.param("captcha_resnet18"), pytest.param("gpt_mini")])
def test_eval_peak_is_the_literal_loops_to_the_byte(workload):
    # The second iteration: the first with a previous output, whose graph (autograd on) is alive until the forward
    # returns. From the third on, MemTracker's module hooks, waiting for a backward that never comes, keep every
    # earlier graph alive, which the plain loop does not: its count is then no longer the loop's.
    spec, batch = WORKLOADS.get(workload).small_case("loop")
    assert membench_peak(spec, batch, "eval") == literal_loop_peak(spec, batch, "eval", 2)


def test_checkpointing_every_layer_is_transformers_own_checkpointing_to_the_byte():
    """`checkpoint:segments=all` is what a user of transformers gets from `activation_checkpointing_enable()`
    (`gradient_checkpointing_enable` before v5): every decoder layer under a non-reentrant checkpoint. On tiny-gpt2
    (2 layers, batch 2, 16 tokens) the default plan leaves the last layer unchecked and keeps 34,176 bytes more
    (966,648 against 932,472, torch 2.13 CPU)."""
    conformance.skip_without_requirement("hf")
    spec, batch = "hf:tiny-gpt2:seq_len=16", 2

    def transformers_checkpointing(model):
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    every_layer = membench_peak(spec, batch, "train", "checkpoint:segments=all")
    assert every_layer == literal_loop_peak(spec, batch, "train", MEASURED_STEP, transformers_checkpointing)
    assert every_layer < membench_peak(spec, batch, "train", "checkpoint")


def test_the_loop_peak_is_steady():
    # the step compared above is the loop's steady state: one more iteration gives the same peak
    spec, batch = LOOP_MLP
    assert literal_loop_peak(spec, batch, "train", MEASURED_STEP) == literal_loop_peak(spec, batch, "train", 3)


# --- the lifetimes themselves, seen from the step's stages ----------------------------------------------------

def _lifetimes(strategy: str, phase: str = "train") -> list[tuple[str, bool, bool]]:
    """(stage, previous output alive, previous loss alive) at each stage mark of the second step: whether the first
    step's output and loss storages still exist (a weak reference to a storage dies with it, views or not)."""
    spec, _ = LOOP_MLP
    case = Case(spec, strategy, phase, 4, "cpu", data="synthetic", warmup=0, steps=1)
    session = Session(case, bind_case(case)[0])
    session.step()
    previous = {name: weakref.ref(value.untyped_storage()) for name, value in session.kept.items()}
    gc.collect()
    seen = []

    def mark(stage: str) -> None:
        seen.append((stage, *(name in previous and previous[name]() is not None for name in ("predicted", "loss"))))

    session.step(mark)
    seen.append(("end", *(name in previous and previous[name]() is not None for name in ("predicted", "loss"))))
    return seen


def test_baseline_frees_the_previous_output_and_loss_where_the_loop_rebinds_them():
    # alive through the forward (the mark comes before it), gone by the backward: `pred =` and `loss =` ran
    assert _lifetimes("baseline") == [("forward", True, True), ("backward", False, False),
                                      ("optimizer", False, False), ("end", False, False)]


def test_grad_accumulation_rebinds_them_per_micro_batch():
    assert _lifetimes("grad_accumulation") == [("forward", True, True), ("backward", False, False),
                                               ("forward", False, False), ("backward", False, False),
                                               ("optimizer", False, False), ("end", False, False)]


def test_del_intermediates_still_releases_them_at_the_end_of_the_step():
    # `end_step(kept)` keeps its meaning: nothing of the previous step is alive in the next forward
    assert _lifetimes("del_intermediates")[0] == ("forward", False, False)
    spec, _ = LOOP_MLP
    for strategy, kept in (("baseline", {"predicted", "loss"}), ("del_intermediates", set())):
        case = Case(spec, strategy, "train", 4, "cpu", data="synthetic", warmup=0, steps=1)
        session = Session(case, bind_case(case)[0])
        session.step()
        assert set(session.kept) == kept, strategy


def test_eval_keeps_the_previous_output_through_the_forward():
    assert _lifetimes("baseline", "eval") == [("forward", True, False), ("end", False, False)]
    assert _lifetimes("del_intermediates", "eval") == [("forward", False, False), ("end", False, False)]
