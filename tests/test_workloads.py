"""Every registered workload x every registered strategy: verified against that workload's baseline, or a visible
`unsupported` row with its reason; the exact CPU tracker against PyTorch's MemTracker on every workload.

Workloads run at small options (SMALL) so that the whole grid stays within seconds; a workload registered without
an entry in SMALL, or a strategy without expectations here, fails the suite.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

from bench.core.errors import UsageError
from bench.run.runner import Case, bind_case, memory_pass, run_case
from strategies import STRATEGIES, Strategy
from workloads import WORKLOADS, Workload, get_workload, workload_names
from workloads.loader import resolve_workload

HAS_TIMM = importlib.util.find_spec("timm") is not None
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

# workload name -> a small spec and batch size for the grid (the workload's own tests check its defaults)
SMALL = {
    "captcha_resnet18": ("captcha_resnet18", 2),
    "deep_mlp": ("deep_mlp:layers=24:width=8", 8),
    "unet": ("unet:depth=2:base_channels=4:image_size=32x16", 2),
    "gpt_mini": ("gpt_mini:layers=2:width=32:heads=2:seq_len=16", 2),
    "timm": ("timm:test_resnet:img_size=64", 4),  # at 32x32 and batch 2 the last BatchNorms see 2 values: bf16 diverges
    "hf": ("hf:tiny-llama:seq_len=16", 2),  # the llama presets' architecture at a tiny width
}

# (workload, strategy) -> the reason the strategy cannot apply to the workload on the CPU, in any phase
UNSUPPORTED = {
    ("deep_mlp", "inplace_relu"): "no ReLU-like activation",
    ("gpt_mini", "inplace_relu"): "no ReLU-like activation",
    ("timm", "inplace_relu"): "in place already",
    ("deep_mlp", "bn_act_recompute"): "has no BatchNorm layer",
    ("gpt_mini", "bn_act_recompute"): "has no BatchNorm layer",
    ("deep_mlp", "inplace_abn"): "has no BatchNorm layer",
    ("gpt_mini", "inplace_abn"): "has no BatchNorm layer",
    ("hf", "inplace_relu"): "no ReLU-like activation",  # SiLU (llama), GELU (gpt2, bert)
    ("hf", "bn_act_recompute"): "has no BatchNorm layer",  # LayerNorm, RMSNorm
    ("hf", "inplace_abn"): "has no BatchNorm layer",
    ("captcha_resnet18", "chunked_loss"): "has no separable output head",
    ("deep_mlp", "chunked_loss"): "has no separable output head",
    ("unet", "chunked_loss"): "has no separable output head",
    ("timm", "chunked_loss"): "has no separable output head",
    ("captcha_resnet18", "lora"): "is not an hf: architecture",
    ("deep_mlp", "lora"): "is not an hf: architecture",
    ("unet", "lora"): "is not an hf: architecture",
    ("gpt_mini", "lora"): "is not an hf: architecture",
    ("timm", "lora"): "is not an hf: architecture",
    **{(workload, "qlora"): "is not an hf: architecture"  # targets=all-linear: peft leaves a transformers head out
       for workload in ("captcha_resnet18", "deep_mlp", "unet", "gpt_mini", "timm")},
}
# strategy -> phases it runs in on the CPU on any workload (cudnn_benchmark, empty_cache, pinned_loader: CUDA only)
PHASES = {"baseline": ("train", "eval"), "inplace_relu": ("train", "eval"), "checkpoint": ("train", "eval"),
          "amp": ("train", "eval"), "del_intermediates": ("train", "eval"), "no_grad_eval": ("eval",),
          "cudnn_benchmark": (), "selective_checkpoint": ("train",), "offload": (), "offload_activations": (),
          "compile": ("train",),
          "ddp": (), "zero1": (), "fsdp": (),  # sharded: need --ranks (tests/test_ranks.py)
          "grad_accumulation": ("train",), "optimizer_in_backward": ("train",),
          "optimizer": ("train",), "keep_grads": ("train",), "empty_cache": (), "pinned_loader": (),
          "pitfall_loss_sum": ("train", "eval"), "pitfall_retain_graph": ("train",),
          "bn_act_recompute": ("train",), "inplace_abn": ("train",), "chunked_loss": ("train",),
          "lora": ("train",), "qlora": ("train",), "bf16_weights": ("train", "eval")}
# the spec a strategy runs as here where its defaults are too slow for `make test` (inductor compiles C++ for ~30 s
# per pass on a 2-core CPU; the eager partition backend runs the same partitioned graphs), or where the tiny model
# cannot take them (torchao's NF4 needs 256 blocks of 64 per weight scale: hf:tiny-llama's weights have 8 to 32)
FAST_SPECS = {"compile": "compile:backend=aot_eager_decomp_partition", "qlora": "qlora:scaler_block=8"}
# (workload, strategy) -> why the row runs but cannot match the baseline, by design (words of its message)
DIFFERS = {
    ("captcha_resnet18", "grad_accumulation"): "BatchNorm normalises each of the 2 micro-batches",
    ("unet", "grad_accumulation"): "BatchNorm normalises each of the 2 micro-batches",
    ("timm", "grad_accumulation"): "BatchNorm normalises each of the 2 micro-batches",
    ("gpt_mini", "grad_accumulation"): "dropout draws its masks per micro-batch",
    ("gpt_mini", "compile"): "another random stream than eager dropout",
    ("captcha_resnet18", "inplace_abn"): "is a leaky ReLU of slope",
    ("unet", "inplace_abn"): "is a leaky ReLU of slope",
    ("timm", "inplace_abn"): "is a leaky ReLU of slope",
    ("hf", "lora"): "the base weights are frozen",
    ("hf", "qlora"): "are stored in 4-bit NF4",
    **{(workload, "bf16_weights"): "are bfloat16 (8-bit mantissa)" for workload in SMALL},
}


def _case(workload: str, strategy: str, phase: str, batch: int | None = None) -> Case:
    spec, small_batch = SMALL[workload]
    return Case(spec, strategy, phase, batch or small_batch, "cpu", data="synthetic", warmup=0, steps=1)


def _needs(workload: str):
    if workload == "hf":
        return pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
    return pytest.mark.skipif(workload == "timm" and not (HAS_TIMM and "timm" in workload_names()),
                              reason="timm is not installed")


def _grid():
    for workload in workload_names():
        for strategy in STRATEGIES.names():
            for phase in ("train", "eval"):
                yield pytest.param(workload, strategy, phase, id=f"{workload}-{strategy}-{phase}",
                                   marks=_needs(workload))


def test_every_workload_and_strategy_has_expectations():
    missing = set(workload_names()) - set(SMALL)
    assert not missing, f"a new workload without a test fails the suite: add {sorted(missing)} to SMALL"
    missing = set(STRATEGIES.names()) - set(PHASES)
    assert not missing, f"a new strategy without a test fails the suite: add {sorted(missing)} to PHASES"


@pytest.mark.parametrize("workload,strategy,phase", list(_grid()))
def test_strategy_on_workload_matches_or_says_why(workload, strategy, phase):
    row = run_case(_case(workload, FAST_SPECS.get(strategy, strategy), phase), env={})
    reason = UNSUPPORTED.get((workload, strategy))
    if reason:
        assert row["status"] == "unsupported" and reason in row["message"], row
    elif phase not in PHASES[strategy]:
        assert row["status"] == "unsupported", row
        assert any(word in row["message"] for word in (phase, "cuda", "--ranks")), row
    elif (workload, strategy) in DIFFERS:
        assert row["status"] == "ok", row["message"]
        assert row["matches_baseline"] is False and DIFFERS[(workload, strategy)] in row["message"], row
    else:
        assert row["status"] == "ok", row["message"]
        assert row["matches_baseline"] is True, row
        assert row["params_without_grad"] == 0 and row["bn_stats_match"] is True, row
        assert row["peak_mem_bytes"] > 0, row
        # a steady loop gives back every step's memory; summing the loss with autograd on (eval) never does
        grows = (strategy, phase) == ("pitfall_loss_sum", "eval")
        assert (row["mem_growth_bytes_per_step"] > 0) is grows, row
    assert row["workload"] == get_workload(SMALL[workload][0]).spec()


@pytest.mark.parametrize("workload", [pytest.param(w, marks=_needs(w)) for w in SMALL])
def test_checkpoint_lowers_the_train_peak(workload):
    spec, _ = SMALL[workload]
    batch = {"deep_mlp": 64, "gpt_mini": 4}.get(workload, 4)
    peaks = {}
    for strategy in ("baseline", "checkpoint"):
        case = Case(spec, strategy, "train", batch, "cpu", data="synthetic", warmup=0, steps=1)
        peaks[strategy] = memory_pass(case, bind_case(case)[0])["peak_mem_bytes"]
    assert peaks["checkpoint"] < peaks["baseline"], peaks


# --- dropout: verification sees the random state -------------------------------------------------------

def test_dropout_masks_repeat_and_checkpoint_recomputes_them(temporary_strategy):
    """gpt_mini has dropout: the same seed gives the same masks (checkpoint matches, its recompute replaying the
    random state), and a strategy that shifts the random stream before the forward is caught."""
    @temporary_strategy
    class DrawsRandom(Strategy):
        name = "test_draws_random"

        def forward(self):
            torch.rand(1)  # moves the global generator: every dropout mask changes
            return super().forward()

    spec, batch = SMALL["gpt_mini"]
    assert get_workload(spec).settings["dropout"] > 0
    ok = run_case(Case(spec, "checkpoint:segments=2", "train", batch, "cpu", data="synthetic", warmup=0, steps=1))
    assert ok["status"] == "ok" and ok["matches_baseline"] is True and ok["loss_rel_diff"] == 0.0, ok
    shifted = run_case(Case(spec, "test_draws_random", "train", batch, "cpu", data="synthetic", warmup=0, steps=1))
    assert shifted["status"] == "ok" and shifted["matches_baseline"] is False, shifted


# --- naming a workload ------------------------------------------------------------------------------------

def test_options_are_parsed_recorded_and_checked():
    workload = resolve_workload("deep_mlp:layers=7:width=3")
    assert workload.settings == {"layers": 7, "width": 3} and workload.spec() == "deep_mlp:layers=7:width=3"
    assert resolve_workload("deep_mlp:width=10").spec() == "deep_mlp"  # defaults are left out of the spec
    row = run_case(Case("deep_mlp:layers=7:width=3", "baseline", "train", 2, "cpu", warmup=0, steps=1), env={})
    assert row["workload"] == "deep_mlp:layers=7:width=3" and row["workload_settings"] == "layers=7;width=3"
    for bad, words in [("deep_mlp:depth=3", "unknown option of workload 'deep_mlp'"),
                       ("deep_mlp:layers=many", "bad value 'many' for deep_mlp:layers"),
                       ("deep_mlp:layers=0", "deep_mlp:layers=0 must be at least 1"),
                       ("deep_mlp:layers", "expected deep_mlp:option=value")]:
        with pytest.raises(UsageError, match=words):
            resolve_workload(bad)


USER_FILE = '''
import torch
from torch import nn
from workloads import Workload


class Tiny(Workload):
    """A user's own two-layer model."""
    default_batch_size = 4
    options = {"hidden": 8}

    def build_model(self):
        return nn.Sequential(nn.Linear(3, self.settings["hidden"]), nn.ReLU(), nn.Linear(self.settings["hidden"], 2))

    def make_batch(self, batch_size, data="synthetic"):
        gen = torch.Generator().manual_seed(self.seed)
        return {"input": torch.rand(batch_size, 3, generator=gen)}, torch.rand(batch_size, 2, generator=gen)

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)


def make_tiny():
    return Tiny(hidden=5)


NOT_A_WORKLOAD = 3
'''


def test_user_workload_from_a_file_with_dict_inputs(tmp_path, monkeypatch):
    path = tmp_path / "mine.py"
    path.write_text(USER_FILE)
    monkeypatch.chdir(tmp_path)
    workload = resolve_workload("mine.py:Tiny:hidden=6")
    assert workload.spec() == "mine.py:Tiny:hidden=6" and workload.settings == {"hidden": 6}
    assert resolve_workload("mine.py:make_tiny").settings == {"hidden": 5}  # a function returning one
    for strategy in ("checkpoint", "inplace_relu"):
        row = run_case(Case("mine.py:Tiny", strategy, "train", 4, "cpu", warmup=0, steps=1), env={})
        assert row["status"] == "ok" and row["matches_baseline"] is True, row


@pytest.mark.parametrize("spec,words", [
    ("nope.py:x", "workload file 'nope.py' does not exist"),
    ("mine.py:Missing", "'mine.py' has no 'Missing'"),
    ("mine.py:NOT_A_WORKLOAD", "not a Workload subclass or a function"),
    ("mine.py", "names no object"),
    ("no_such_package.module:Thing", "workload module 'no_such_package.module' not found"),
    ("nonsense", "unknown workload 'nonsense'; valid choices: captcha_resnet18"),
])
def test_bad_workload_references_are_one_line_errors(tmp_path, monkeypatch, spec, words):
    (tmp_path / "mine.py").write_text(USER_FILE)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=words) as caught:
        resolve_workload(spec)
    assert "\n" not in str(caught.value)


def test_entry_point_workloads_are_registered(monkeypatch):
    import importlib.metadata

    from workloads import loader

    class Plugged(Workload):
        name = "plugged_in"

    class FakeEntryPoint:
        name, value = "plugged_in", "somepackage.workloads:Plugged"

        def load(self):
            return Plugged

    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: [FakeEntryPoint()] if group == loader.ENTRY_POINT_GROUP else [])
    loader.load_entry_points.cache_clear()
    try:
        assert "plugged_in" in workload_names()
        assert isinstance(resolve_workload("plugged_in"), Plugged)
    finally:
        WORKLOADS.unregister("plugged_in")
        loader.load_entry_points.cache_clear()


def test_unknown_data_source_names_the_workload_and_its_choices():
    with pytest.raises(UsageError, match=r"unknown data source 'captcha' for workload 'deep_mlp'; valid choices: "
                                         r"synthetic"):
        get_workload("deep_mlp").check_data("captcha")


@functools.lru_cache(maxsize=None)
def _registered_defaults() -> dict[str, Workload]:
    return {name: WORKLOADS.get(name) for name in workload_names()}


def test_every_workload_declares_its_defaults():
    for name, cls in _registered_defaults().items():
        assert cls.description and cls.default_batch_size > 0 and cls.data_sources, name
