"""The baseline's peak is a literal training loop's peak, to the byte (issue 24 §1), on every built-in workload.

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
import importlib.util
import warnings
import weakref

import pytest
import torch

from bench.run.runner import Case, Session, bind_case, memory_pass, seed_everything
from bench.run.passes import MEMORY_WARMUP_STEPS
from workloads import get_workload, workload_names

mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")

HAS_TIMM = importlib.util.find_spec("timm") is not None
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

# workload name -> its smallest options and batch here (a registered workload without an entry fails the suite)
LOOP = {
    "captcha_resnet18": ("captcha_resnet18", 2),
    "deep_mlp": ("deep_mlp:layers=24:width=8", 64),  # batch 64: the peak falls in backward
    "unet": ("unet:depth=2:base_channels=4:image_size=32x16", 2),
    "gpt_mini": ("gpt_mini:layers=2:width=32:heads=2:seq_len=16", 2),  # with dropout: the seeded masks
    "timm": ("timm:test_resnet:img_size=32", 2),
    "hf": ("hf:tiny-llama:seq_len=16", 2),  # dict inputs, a ModelOutput
}
# membench's measured step is the one after its warm-up steps; the loop's is the same one
MEASURED_STEP = MEMORY_WARMUP_STEPS["cpu"] + 1


def _needs(workload: str):
    if workload == "hf":
        return pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed (membench[hf])")
    return pytest.mark.skipif(workload == "timm" and not (HAS_TIMM and "timm" in workload_names()),
                              reason="timm is not installed (membench[timm])")


WORKLOADS = [pytest.param(w, marks=_needs(w)) for w in LOOP]


def literal_loop_peak(spec: str, batch: int, phase: str, steps: int, prepare=None) -> int:
    """The peak bytes of the last of `steps` iterations of the literal loop, counted by MemTracker; `prepare(model)`
    is what the user's script does to the model before the optimizer is made (a library's checkpointing switch)."""
    workload = get_workload(spec)
    seed_everything(workload.seed)  # as Session: the weights, then the batch, then the steps' random state
    model = workload.build_model()
    if prepare is not None:
        prepare(model)
    optimizer = workload.make_optimizer(model)
    x, y = workload.make_batch(batch, "synthetic")
    model.train(phase == "train")
    seed_everything(workload.seed + 1)
    tracker = mem_tracker.MemTracker()
    tracker.track_external(model, optimizer, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MemTracker warns about module hooks it skips
        for _ in range(steps):
            tracker.reset_mod_stats()  # it refuses a module's second forward otherwise
            with tracker:  # entering restarts the peak from what is live: the peak is this iteration's
                pred = workload.run_model(model, x)  # model(x), model(*x) or model(**x)
                if phase == "train":
                    loss = workload.loss(pred, y)
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def membench_peak(spec: str, batch: int, phase: str, strategy: str = "baseline") -> int:
    case = Case(spec, strategy, phase, batch, "cpu", data="synthetic", warmup=0, steps=1)
    return memory_pass(case, bind_case(case)[0])["peak_mem_bytes"]


def test_every_workload_has_a_loop():
    missing = set(workload_names()) - set(LOOP)
    assert not missing, f"a new workload without a loop fails the suite: add {sorted(missing)} to LOOP"


@pytest.mark.parametrize("workload", WORKLOADS)
def test_train_peak_is_the_literal_loops_to_the_byte(workload):
    spec, batch = LOOP[workload]
    assert membench_peak(spec, batch, "train") == literal_loop_peak(spec, batch, "train", MEASURED_STEP)


@pytest.mark.parametrize("workload", [pytest.param("captcha_resnet18"), pytest.param("gpt_mini")])
def test_eval_peak_is_the_literal_loops_to_the_byte(workload):
    # The second iteration: the first with a previous output, whose graph (autograd on) is alive until the forward
    # returns. From the third on, MemTracker's module hooks, waiting for a backward that never comes, keep every
    # earlier graph alive, which the plain loop does not: its count is then no longer the loop's.
    spec, batch = LOOP[workload]
    assert membench_peak(spec, batch, "eval") == literal_loop_peak(spec, batch, "eval", 2)


@_needs("hf")
def test_checkpointing_every_layer_is_transformers_own_checkpointing_to_the_byte():
    """`checkpoint:segments=all` is what a user of transformers gets from `activation_checkpointing_enable()`
    (`gradient_checkpointing_enable` before v5): every decoder layer under a non-reentrant checkpoint. On tiny-gpt2
    (2 layers, batch 2, 16 tokens) the default plan leaves the last layer unchecked and keeps 34,176 bytes more
    (966,648 against 932,472, torch 2.13 CPU)."""
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
    spec, batch = LOOP["deep_mlp"]
    assert literal_loop_peak(spec, batch, "train", MEASURED_STEP) == literal_loop_peak(spec, batch, "train", 3)


# --- the lifetimes themselves, seen from the step's stages ----------------------------------------------------

def _lifetimes(strategy: str, phase: str = "train") -> list[tuple[str, bool, bool]]:
    """(stage, previous output alive, previous loss alive) at each stage mark of the second step: whether the first
    step's output and loss storages still exist (a weak reference to a storage dies with it, views or not)."""
    spec, _ = LOOP["deep_mlp"]
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
    spec, _ = LOOP["deep_mlp"]
    for strategy, kept in (("baseline", {"predicted", "loss"}), ("del_intermediates", set())):
        case = Case(spec, strategy, "train", 4, "cpu", data="synthetic", warmup=0, steps=1)
        session = Session(case, bind_case(case)[0])
        session.step()
        assert set(session.kept) == kept, strategy


def test_eval_keeps_the_previous_output_through_the_forward():
    assert _lifetimes("baseline", "eval") == [("forward", True, False), ("end", False, False)]
    assert _lifetimes("del_intermediates", "eval") == [("forward", False, False), ("end", False, False)]
