"""Predict and fit without the device: the fake-tensor engine against the real CPU count, the model of CUDA's
caching allocator on sequences worked out by hand, cuBLAS's workspace, and the batch search of fit.

Small: batch sizes 1-2, a 4-layer MLP where a workload's size does not matter.
"""

import functools
import json

import pytest
import torch

from bench.analysis import fake_engine, fit as analysis, predict, predict_assumptions
from bench.analysis.fake_engine import fake_memory_pass
from bench.cli.main import main
from bench.core.results import PREDICT, PREDICT_SCHEMA_VERSION
from bench.core.schema import Row
from bench.measure import breakdown, cuda_allocator, sdpa_kernel
from bench.measure.cuda_allocator import CachingAllocatorModel, replay
from bench.measure.memory import LiveTensorTracker, MemoryEvent
from bench.run.case import Case, bind_case
from bench.run.runner import memory_pass

MIB = 2**20
MLP = "deep_mlp:layers=4:width=8"


def case(workload="captcha_resnet18", strategy="baseline", phase="train", batch=2):
    return Case(workload, strategy, phase, batch, "cpu", data="synthetic", warmup=0, steps=1)


@functools.lru_cache(maxsize=None)
def peaks(workload: str, strategy: str, phase: str, batch: int) -> tuple[int, int]:
    """(real CPU tracked peak, fake-tensor tracked peak) of one case (cached: the tests share them)."""
    c = case(workload, strategy, phase, batch)
    real = memory_pass(c, bind_case(c)[0])["peak_mem_bytes"]
    fake = fake_memory_pass(c, bind_case(c)[0])["peak_mem_bytes"]
    return real, fake


# --- the fake-tensor engine against the real CPU count -------------------------------------------------------

@pytest.mark.parametrize("strategy", ["baseline", "checkpoint", "amp", "no_grad_eval"])
def test_fake_engine_counts_what_the_cpu_counts_in_eval(strategy):
    # no loss in the eval step's peak: fake tensors and the CPU hold the same storages, to the byte
    real, fake = peaks("captcha_resnet18", strategy, "eval", 2)
    assert fake == real


@pytest.mark.parametrize("strategy", ["baseline", "amp", "checkpoint", "optimizer_in_backward"])
def test_fake_engine_in_training_counts_the_cpu_loss_buffer(strategy):
    # The CPU's mse_loss returns its mean in the buffer of its elementwise losses (batch x width floats), a meta
    # kernel in a 4-byte one; the fake engine gives the CPU's (bench.measure.fake_cpu): to the byte, and without
    # that correction 2*8*4 - 4 = 60 bytes below (one loss alive at the peak: the step's; the loop frees the previous
    # one when the new loss rebinds `loss`, before the backward)
    real, fake = peaks(MLP, strategy, "train", 2)
    assert fake == real
    c = case(MLP, strategy, "train", 2)
    assert real - fake_memory_pass(c, bind_case(c)[0], cpu_kernels=False)["peak_mem_bytes"] == 2 * 8 * 4 - 4


def test_fake_engine_runs_checkpointing_with_batchnorm_exactly():
    # checkpoint's BatchNorm fix compares buffers by value, which fake tensors have not: it restores them all
    # (in place, nothing allocated)
    real, fake = peaks("captcha_resnet18", "checkpoint", "train", 1)
    assert fake == real


def test_fake_engine_applies_autocast():
    # meta tensors ignore autocast; fake ones do not: the step has the casts autocast inserts
    c = case(MLP, "amp", "eval", 2)
    tracker = LiveTensorTracker("cpu", record_timeline=True)
    fake_memory_pass(c, bind_case(c)[0], tracker=tracker)
    assert any(p.op == "_to_copy.default" for p in tracker.timeline)  # the casts autocast inserts
    with pytest.raises(fake_engine.UsesAutocast):
        fake_engine.tracked_peak(case(MLP, "amp", "eval", 2), "amp", engine="meta")


def test_fake_engine_leaves_the_batch_cache_real():
    from bench.run.case import cpu_batch
    from torch._subclasses.fake_tensor import FakeTensor

    c = case(MLP, "baseline", "eval", 3)
    fake_memory_pass(c, bind_case(c)[0])
    inputs, target = cpu_batch(c.workload, 3, c.data)
    assert not isinstance(inputs, FakeTensor) and not isinstance(target, FakeTensor)


def small_architecture(preset: str) -> dict:
    """A preset's configuration with its architecture (model type, grouped-query heads' ratio, rotary scaling,
    biases, tying, dropout, normalisation) and small sizes: 8 per head, a 256-token vocabulary, two layers' worth of
    heads a quarter of the preset's (at least the grouped-query ratio)."""
    from workloads.framework.hf_presets import PRESETS

    values = dict(PRESETS[preset])
    heads_key = "n_head" if "n_head" in values else "num_attention_heads"
    heads = max(2, values[heads_key] // 4)
    if "num_key_value_heads" in values:
        ratio = values[heads_key] // values["num_key_value_heads"]
        heads = max(ratio, heads // ratio * ratio)
        values["num_key_value_heads"] = heads // ratio
    values[heads_key] = heads
    values["n_embd" if "n_embd" in values else "hidden_size"] = 8 * heads
    if "head_dim" in values:
        values["head_dim"] = 8
    if "intermediate_size" in values:
        values["intermediate_size"] = 16 * heads
    values["vocab_size"] = 256
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in values:
            values[key] = min(values[key], 255)
    return values


@pytest.mark.parametrize("preset", ["gpt2", "bert-base-uncased", "llama-3.2-1b", "llama-3.1-8b", "mistral-7b",
                                    "qwen2.5-7b"])
def test_fake_engine_counts_each_hf_preset_architecture_to_the_byte(preset, tmp_path):
    # The preset's own operators (its attention, rotary embedding, MLP, norms and loss) at layers=2, sequence 16,
    # batch 1, with small widths (an 8B preset's real CPU step would need 24 GB): the fake engine's training peak
    # is the real CPU count's, to the byte (cross-entropy, unlike mse and BCE, returns its mean in its own buffer)
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(small_architecture(preset)))
    c = case(f"hf:{config}:layers=2:seq_len=16", "baseline", "train", 1)
    real = memory_pass(c, bind_case(c)[0], growth_steps=0)["peak_mem_bytes"]
    fake = fake_memory_pass(c, bind_case(c)[0], growth_steps=0)["peak_mem_bytes"]
    assert fake == real


# --- the tracker's event log ---------------------------------------------------------------------------------

def test_event_log_replays_to_the_live_count():
    with LiveTensorTracker(record_events=True) as tracker:
        a = torch.ones(100)
        b = a * 2
        del a
        tracker.reset_peak()
        c = b + 1
        live = tracker.live_bytes
    kinds = [e.kind for e in tracker.events]
    assert kinds.count("alloc") == 3 and kinds.count("free") == 1 and kinds.count("reset") == 1
    alive = {}
    for event in tracker.events:
        if event.kind == "alloc":
            alive[event.key] = event.nbytes
        elif event.kind == "free":
            del alive[event.key]
    assert sum(alive.values()) == live == 800
    assert [e.op for e in tracker.events if e.kind == "op"] == ["ones.default", "mul.Tensor", "add.Tensor"]
    del b, c


# --- the caching allocator model, on sequences worked out by hand ----------------------------------------------

def test_small_requests_share_a_2mib_segment_and_round_to_512():
    model = CachingAllocatorModel()
    a = model.malloc(100)  # 512 bytes from a new 2 MiB small segment, split
    b = model.malloc(1 * MIB)  # 1 MiB is still small: the rest of the same segment
    assert (model.stats.allocated_bytes, model.stats.reserved_bytes, model.stats.segments) == (512 + MIB, 2 * MIB, 1)
    c = model.malloc(MIB - 511)  # rounds to 1 MiB: 2 MiB - 512 - 1 MiB = 1 MiB - 512 left, too small: new segment
    assert (c.size, model.stats.reserved_bytes, model.stats.segments) == (MIB, 4 * MIB, 2)
    assert model.malloc(0) is None and model.stats.allocated_bytes == 512 + 2 * MIB


def test_large_requests_use_20mib_segments_below_10mib_and_2mib_rounding_above():
    model = CachingAllocatorModel()
    a = model.malloc(MIB + 1)  # large: 1 MiB + 512, from a 20 MiB segment, split (19 MiB - 512 > 1 MiB left)
    assert (a.size, model.stats.reserved_bytes) == (MIB + 512, 20 * MIB)
    b = model.malloc(10 * MIB + 1)  # best fit: the 19 MiB - 512 rest of that segment; 9 MiB - 1024 left, split
    assert model.stats.reserved_bytes == 20 * MIB
    c = model.malloc(9 * MIB)  # 9 MiB - 1024 free is too small: a new 20 MiB segment
    assert model.stats.reserved_bytes == 40 * MIB
    d = model.malloc(12 * MIB + 1)  # >= 10 MiB, nothing free fits (11 MiB left): a segment of 14 MiB (2 MiB multiple)
    assert model.stats.reserved_bytes == 54 * MIB and model.stats.segments == 3
    assert model.stats.allocated_bytes == (MIB + 512) + (10 * MIB + 512) + 9 * MIB + (12 * MIB + 512)
    assert model.stats.peak_allocated_bytes == model.stats.allocated_bytes


def test_an_unsplit_block_is_counted_whole_and_freed_blocks_merge():
    model = CachingAllocatorModel()
    a = model.malloc(5 * MIB)  # from a new 20 MiB segment: [a 5][15 free]
    b = model.malloc(14 * MIB + 512)  # the rest would be 1 MiB - 512, not more than 1 MiB: not split, counted whole
    assert b.size == 15 * MIB and model.stats.allocated_bytes == 20 * MIB
    model.free(a)
    model.free(b)  # [5 free][15 free] merge into one 20 MiB block
    assert model.stats.allocated_bytes == 0
    model.reset_peak()
    c = model.malloc(18 * MIB)  # fits the merged block (no new segment); the 2 MiB rest is split off
    assert c.size == 18 * MIB and model.stats.reserved_bytes == 20 * MIB and model.stats.segments == 1
    assert model.stats.peak_allocated_bytes == 18 * MIB and model.stats.peak_reserved_bytes == 20 * MIB


def test_best_fit_takes_the_smallest_free_block_that_fits():
    model = CachingAllocatorModel()
    four, six, five = model.malloc(4 * MIB), model.malloc(6 * MIB), model.malloc(5 * MIB)  # [4][6][5][5 free]
    model.free(four)  # a 4 MiB hole between the segment's start and `six`
    model.free(five)  # merges with the free rest: a 10 MiB hole
    d = model.malloc(3 * MIB + 512)  # best fit is the 4 MiB hole; its rest (1 MiB - 512) stays in the block
    assert d.address == four.address and d.size == 4 * MIB
    assert model.stats.reserved_bytes == 20 * MIB and model.stats.allocated_bytes == 10 * MIB


def test_replay_counts_one_cublas_workspace_per_thread_like_pytorch_issue_95668():
    # after one nn.Linear, 8,519,680 bytes stay allocated in a 20 MiB segment (12,451,840 inactive)
    events = [MemoryEvent("op", stage="forward", op="addmm.default"), MemoryEvent("alloc", 1, 40, "forward"),
              MemoryEvent("op", stage="forward", op="mm.default"), MemoryEvent("reset", stage="backward"),
              MemoryEvent("op", stage="backward", op="mm.default"), MemoryEvent("free", 1, stage="backward")]
    result = replay(events, cuda_allocator.CUBLAS_DEFAULT_WORKSPACE_BYTES)
    assert result.cublas_workspaces == 2  # the forward's thread and autograd's backward thread
    assert result.max_allocated_bytes == 2 * 8_519_680 + 512
    assert result.max_reserved_bytes == 20 * MIB + 2 * MIB  # both workspaces fit one 20 MiB segment; 512 B: 2 MiB
    assert replay(events, 0).max_allocated_bytes == 512


def test_replay_says_what_the_allocated_peak_is_made_of_by_category():
    # 3 MiB of weights, then a 2 MiB activation re-filed as logits before the peak, then 1 MiB of forward scratch
    # (large: 20 MiB segments); after the peak the logits become "grads": the peak's split stays as it was
    events = [MemoryEvent("category", 1, op="params"), MemoryEvent("alloc", 1, 3 * MIB),
              MemoryEvent("reset"), MemoryEvent("category", 2, op="forward"), MemoryEvent("alloc", 2, 2 * MIB),
              MemoryEvent("category", 2, op="logits"), MemoryEvent("category", 3, op="forward"),
              MemoryEvent("alloc", 3, MIB + 1), MemoryEvent("free", 3), MemoryEvent("category", 2, op="grads"),
              MemoryEvent("alloc", 4, 100)]
    result = replay(events, 0)
    assert result.max_allocated_bytes == 6 * MIB + 512
    assert result.peak_by_category == {"params": 3 * MIB, "logits": 2 * MIB, "forward": MIB + 512}
    assert sum(result.peak_by_category.values()) == result.max_allocated_bytes
    workspace = replay([MemoryEvent("op", stage="forward", op="mm.default"), *events], 8_519_680)
    assert workspace.peak_by_category[cuda_allocator.CUBLAS_WORKSPACE] == 8_519_680
    assert sum(workspace.peak_by_category.values()) == workspace.max_allocated_bytes


def test_replay_leaves_unified_memory_out_of_the_caching_allocator():
    # bitsandbytes' paged state (cudaMallocManaged) is no block of the allocator: 3 MiB of weights, 2 x 16 MiB of
    # paged codes (filed by a "category" event, or by the alloc's own category in a log without them), 1 MiB scratch
    events = [MemoryEvent("category", 1, op="params"), MemoryEvent("alloc", 1, 3 * MIB),
              MemoryEvent("category", 2, op="unified_memory"), MemoryEvent("alloc", 2, 16 * MIB),
              MemoryEvent("alloc", 3, 16 * MIB, category="unified_memory"),
              MemoryEvent("reset"), MemoryEvent("category", 2, op="optimizer_state"),
              MemoryEvent("alloc", 4, MIB + 1, category="optimizer"), MemoryEvent("free", 4), MemoryEvent("free", 2)]
    result = replay(events, 0)
    assert result.max_allocated_bytes == 4 * MIB + 512  # the weights and the scratch only
    assert result.max_reserved_bytes == 20 * MIB  # one 20 MiB segment holds both (the codes would need 32 MiB more)
    assert result.peak_by_category == {"params": 3 * MIB, "uncategorized": MIB + 512}
    assert result.stats.allocated_bytes == 3 * MIB  # the paged codes' frees touch no block


@pytest.mark.parametrize("capability, config, expected", [
    (None, None, 8_519_680), ((8, 6), None, 8_519_680), ((9, 0), None, 32 * MIB), ((10, 0), None, 8_519_680),
    (None, ":4096:8", 32 * MIB), ((9, 0), ":16:8", 131_072), (None, ":4096:2:16:8", 8_519_680),
    ((9, 0), "nonsense", 32 * MIB),
])
def test_cublas_workspace_size(capability, config, expected):
    assert cuda_allocator.cublas_workspace_bytes(capability, config) == expected


# --- predict -------------------------------------------------------------------------------------------------

def test_predict_cuda_gives_allocated_and_reserved_with_the_workspaces():
    row = predict.predict_case(Case("captcha_resnet18", "baseline", "train", 2, "cuda", data="synthetic"))
    assert row["status"] == "ok" and row["engine"] == "fake", row
    _, fake = peaks("captcha_resnet18", "baseline", "train", 2)
    workspaces = row["cublas_workspace_bytes"]
    assert workspaces == 2 * 8_519_680  # fc layers: addmm in the forward, mm in the backward
    # allocated: the tensors and the workspaces, each in its block: 512 B multiples, and a large block whose rest
    # would be 1 MiB or less handed out whole (measured here: 1.9% more than the tensors' bytes)
    assert fake + workspaces <= row["predicted_bytes"] <= (fake + workspaces) * 1.03
    assert row["predicted_reserved_bytes"] >= row["predicted_bytes"]
    assert row["predicted_reserved_bytes"] % (2 * MIB) == 0


PARTS = ["predicted_weights_bytes", "predicted_grads_bytes", "predicted_optimizer_state_bytes",
         "predicted_activations_bytes", "predicted_logits_bytes", "predicted_other_bytes"]


@pytest.mark.parametrize("device", ["cuda", "cpu"], ids=["for-gpu", "for-cpu"])  # "cuda" would mark it GPU-only
def test_predict_splits_the_peak_into_weights_state_activations_and_logits(device):
    # A causal LM (its head's output is the logits) in training: the parts add up to the predicted peak; the
    # weights are every parameter (on CUDA each in its 512-byte block), Adam's state two of each (on the CPU also
    # its 4-byte step per parameter); the logits (batch x sequence x vocabulary floats) are counted apart
    pytest.importorskip("transformers")
    row = predict.predict_case(Case("hf:tiny-llama:seq_len=16", "baseline", "train", 1, device, data="synthetic"))
    assert row["status"] == "ok", row
    assert sum(row[part] for part in PARTS) == row["predicted_bytes"]
    from workloads import get_workload

    params = list(get_workload("hf:tiny-llama:seq_len=16").build_model().parameters())
    exact = sum(p.numel() * 4 for p in params)
    if device == "cuda":
        assert row["predicted_weights_bytes"] == sum(cuda_allocator.round_size(p.numel() * 4) for p in params)
        # Adam's `step` counts are host tensors on CUDA; the fake engine (the CPU's operators, all on one device)
        # counts them too, one 512-byte block each
        steps = 512 * len(params) if row["engine"] == "fake" else 0
        assert row["predicted_optimizer_state_bytes"] == 2 * row["predicted_weights_bytes"] + steps
    else:
        assert row["predicted_weights_bytes"] == exact
        assert row["predicted_optimizer_state_bytes"] == 2 * exact + 4 * len(params)
    logits = 1 * 16 * 512 * 4
    assert row["predicted_logits_bytes"] >= logits and row["predicted_logits_bytes"] % logits == 0
    mlp = predict.predict_case(Case(MLP, "baseline", "train", 2, device, data="synthetic"))
    assert mlp["predicted_logits_bytes"] == 0 and sum(mlp[part] for part in PARTS) == mlp["predicted_bytes"]


def test_a_predict_row_names_the_recompute_plan_it_used():
    # hf:tiny-llama has 2 decoder layers: the default plan checkpoints layer 0 only (the last segment runs plainly),
    # segments=all both, also composed; in eval nothing is recomputed, whatever the plan
    pytest.importorskip("transformers")
    plans = {}
    for spec in ("checkpoint", "amp+checkpoint:segments=all"):
        row = predict.predict_case(Case("hf:tiny-llama:seq_len=8", spec, "train", 1, "cpu", data="synthetic"))
        assert row["status"] == "ok", row
        plans[spec] = row["recompute_plan"]
    for spec, phase in (("baseline", "train"), ("selective_checkpoint", "train"), ("checkpoint", "eval")):
        plans[f"{spec} {phase}"] = predict.predict_case(Case(MLP, spec, phase, 2, "cpu", data="synthetic"))[
            "recompute_plan"]
    assert plans == {"checkpoint": "0", "amp+checkpoint:segments=all": "0 1", "baseline train": "none",
                     "selective_checkpoint train": "each unit, saving compute", "checkpoint eval": "none"}


def test_chunked_loss_predicts_less_logits_at_the_peak():
    pytest.importorskip("transformers")
    whole, chunked = (predict.predict_case(Case("hf:tiny-llama:seq_len=32", spec, "train", 2, "cuda",
                                                data="synthetic")) for spec in ("baseline", "chunked_loss:chunks=4"))
    assert whole["status"] == chunked["status"] == "ok", (whole, chunked)
    assert chunked["predicted_logits_bytes"] < whole["predicted_logits_bytes"]


def test_a_cuda_prediction_on_the_cpu_s_operators_says_its_attention_is_not_cuda_s():
    # without the fake-CUDA environment a CUDA case is traced on the CPU's operators, whose attention kernel keeps
    # no probabilities; CUDA's math kernel (float32 with grouped-query heads) keeps them: llama-3.1-8b at 4096
    # tokens was 146.2 GiB here against 209.8 GiB on fake CUDA, and no row said so
    pytest.importorskip("transformers")
    llama = predict.predict_case(Case("hf:tiny-llama:seq_len=32", "baseline", "train", 2, "cuda", data="synthetic"))
    assert llama["status"] == "ok" and llama["engine"] != "fake-cuda", llama
    assert predict.CPU_ATTENTION_NOTE in llama["message"], llama
    on_cpu = predict.predict_case(Case("hf:tiny-llama:seq_len=32", "baseline", "train", 2, "cpu", data="synthetic"))
    assert predict.CPU_ATTENTION_NOTE not in (on_cpu["message"] or "")  # the CPU's kernel is the CPU's answer
    mlp = predict.predict_case(Case(MLP, "baseline", "train", 2, "cuda", data="synthetic"))
    assert predict.CPU_ATTENTION_NOTE not in (mlp["message"] or "")  # no attention


def test_sdpa_priority_order_and_hardware_ranges_follow_pytorch(monkeypatch):
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", raising=False)
    assert sdpa_kernel.priority_order((9, 0), 92000) == ["cudnn", "flash", "efficient", "math"]
    assert sdpa_kernel.priority_order((10, 0), 91501) == ["cudnn", "flash", "efficient", "math"]
    assert sdpa_kernel.priority_order((9, 0), 91500) == ["flash", "efficient", "math", "cudnn"]  # cuDNN not > 9.15
    assert sdpa_kernel.priority_order((8, 0), 92000) == ["flash", "efficient", "math", "cudnn"]
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert sdpa_kernel.priority_order((9, 0), 92000)[0] == "flash"
    assert sdpa_kernel.runs_on("flash", (8, 0)) and not sdpa_kernel.runs_on("flash", (7, 5))
    assert sdpa_kernel.runs_on("efficient", (7, 5)) and not sdpa_kernel.runs_on("efficient", (3, 7))
    assert not sdpa_kernel.runs_on("cudnn", (7, 5)) and sdpa_kernel.runs_on("math", (3, 7))


def test_predict_cuda_on_hopper_counts_its_32mib_workspace():
    row = predict.predict_case(Case(MLP, "baseline", "eval", 2, "cuda", data="synthetic"), capability=(9, 0))
    assert row["cublas_workspace_bytes"] == 32 * MIB  # eval: the forward's thread only


def test_assumptions_name_the_engines_used_and_only_those():
    per_engine, every = predict_assumptions.ENGINE_ASSUMPTIONS, predict_assumptions.ASSUMPTIONS
    fake_only = predict_assumptions.assumptions(["fake", "fake", None])
    assert fake_only[:2] == per_engine["fake"] and fake_only[2:] == every
    assert not any("fake-cuda" in line or line.startswith("engine cpu") for line in fake_only)
    both = predict_assumptions.assumptions(["cpu", "fake-cuda"])
    assert both == per_engine["fake-cuda"] + per_engine["cpu"] + every
    assert "CUDA's autocast op lists" in both[0] and "cuDNN's batch norm" in both[0]


def test_assumptions_count_the_workspaces_and_name_where_they_are_not_modelled():
    text = " ".join(predict_assumptions.ASSUMPTIONS)
    counted = [a for a in predict_assumptions.ASSUMPTIONS if a.startswith("counted")]
    assert "cuBLAS" in counted[0] and "8,519,680" in counted[0]
    cudnn = next(a for a in counted if "cuDNN" in a)
    assert "compute capability 9.0" in cudnn and "not modelled on other GPUs" in cudnn and "cudnn.benchmark" in cudnn
    assert "reserved" in text and "2 MiB" in text and "20 MiB" in text


def test_predict_cli_prints_both_figures_and_the_engine(capsys, tmp_path):
    import pandas as pd

    assert main(["predict", "--device", "cuda", "--workload", MLP, "--batch-size", "2", "--strategies", "amp",
                 "--phases", "train", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "reserved MiB" in out and "cuBLAS MiB" in out and "fake" in out
    frame = pd.read_csv(next(tmp_path.glob("predict-*.csv")))
    assert list(frame.columns) == PREDICT.names  # the declared columns, in the order the files always had
    assert (frame["schema_version"] == PREDICT_SCHEMA_VERSION).all()
    assert set(frame["engine"]) == {"fake"}
    assert (frame["predicted_reserved_bytes"] >= frame["predicted_bytes"]).all()


def test_predict_without_the_fake_cuda_environment_runs_the_cpus_operators_or_says_why_not(capsys):
    cases = [Case(MLP, "baseline", "eval", 2, "cuda", data="synthetic")]
    assert [row["engine"] for row in predict.predict_cases(cases)] == ["fake"]
    assert main(["predict", "--engine", "fake-cuda", "--workload", MLP, "--batch-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "--engine fake-cuda" in err and "make cuda-fake-env" in err and err.count("\n") == 1


def test_predict_rejects_the_fake_cuda_engine_for_the_cpu(capsys):
    assert main(["predict", "--device", "cpu", "--engine", "fake-cuda", "--workload", MLP]) == 2
    err = capsys.readouterr().err
    assert "--engine fake-cuda" in err and "auto, fake, meta, cpu" in err and err.count("\n") == 1


def test_predict_says_so_when_the_fake_cuda_environment_fails(monkeypatch):
    from pathlib import Path

    from bench.measure import fake_cuda

    monkeypatch.setattr(fake_cuda, "environment_python", lambda venv=None: Path("/bin/false"))
    cases = [Case(MLP, "baseline", "eval", 2, "cuda", data="synthetic"),
             Case(MLP, "baseline", "eval", 2, "cpu", data="synthetic")]
    cuda_row, cpu_row = predict.predict_cases(cases)
    assert cuda_row["status"] == "ok" and cuda_row["engine"] == "fake", cuda_row
    assert cuda_row["message"] == "the fake-CUDA environment failed (its Python exited with code 1): predicted here"
    assert cpu_row["engine"] == "fake" and cpu_row["message"] == ""


def test_predict_cli_rejects_a_bad_capability(capsys):
    assert main(["predict", "--capability", "hopper"]) == 2
    err = capsys.readouterr().err
    assert "--capability" in err and "MAJOR.MINOR" in err and err.count("\n") == 1


def test_predict_falls_back_to_a_real_cpu_step_and_says_so(monkeypatch):
    def no_fake(*args, **kwargs):
        raise RuntimeError("fake tensors cannot run this")

    monkeypatch.setattr(fake_engine, "fake_memory_pass", no_fake)
    row = predict.predict_case(Case(MLP, "baseline", "eval", 2, "cuda", data="synthetic"))
    assert row["status"] == "ok" and row["engine"] == "cpu"
    assert "fake engine failed (RuntimeError): ran on the cpu" in row["message"]


# --- fit's batch search ----------------------------------------------------------------------------------------

def test_largest_under_finds_the_boundary_in_few_probes():
    calls = []

    def peak(b):  # Adam's step dominates small batches, the backward large ones: two regimes
        calls.append(b)
        return max(1_000_000, 200_000 + 37_003 * b)

    budget = 200_000 + 37_003 * 149 + 1000
    assert analysis.largest_under(peak, budget, 16, 32, 4096) == 149
    assert len(set(calls)) <= 5
    assert analysis.largest_under(peak, 999_999, 16, 32, 4096) == 0
    assert analysis.largest_under(peak, 10**12, 16, 32, 300) == 300


def test_a_prediction_is_a_row_of_the_predict_table_with_every_column_even_when_refused():
    ok = predict.predict_case(Case(MLP, "baseline", "eval", 2, "cpu", data="synthetic"))
    refused = predict.predict_case(Case(MLP, "inplace_relu", "train", 2, "cpu", data="synthetic"))
    for row in (ok, refused):
        assert isinstance(row, Row) and row.table is PREDICT and list(row) == PREDICT.names
        assert row["schema_version"] == PREDICT_SCHEMA_VERSION
    assert ok["predicted_mib"] == round(ok["predicted_bytes"] / MIB, 1) and refused["predicted_mib"] is None
    with pytest.raises(KeyError, match="not a column of the predict table"):
        ok["predicted_gb"] = 1


def test_rows_from_the_fake_cuda_environment_come_back_as_rows_of_the_predict_table(monkeypatch, tmp_path):
    import json
    import subprocess

    from bench.analysis import fake_cuda_worker
    import sys
    from pathlib import Path

    from bench.measure import fake_cuda

    sent = {"workload": MLP, "strategy": "baseline", "phase": "eval", "batch_size": 2, "device": "cuda",
            "predicted_bytes": 1024, "engine": "fake-cuda", "status": "ok", "message": "", "schema_version": 1}

    def worker(argv, **kwargs):  # what `python -m bench.analysis._predict_worker REQUEST ROWS` leaves
        Path(argv[-1]).write_text(json.dumps({"rows": [sent]}))
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(fake_cuda, "environment_python", lambda venv=None: Path(sys.executable))
    monkeypatch.setattr(fake_cuda_worker.processes, "run_child", worker)  # how the worker is started
    monkeypatch.setattr(predict.torch.cuda, "is_available", lambda: False)
    [row] = predict.predict_cases([Case(MLP, "baseline", "eval", 2, "cuda", data="synthetic")])
    assert isinstance(row, Row) and row.table is PREDICT and row["predicted_bytes"] == 1024
    sent["predicted_gib"] = 1  # a worker of another version, with a column this one does not declare: refused
    with pytest.raises(KeyError, match="predicted_gib"):
        predict.predict_cases([Case(MLP, "baseline", "eval", 2, "cuda", data="synthetic")])


def test_predict_marks_a_strategy_the_model_refuses_unsupported():
    # inplace_relu passes its check, then finds no ReLU in the MLP when it meets the model: no engine can run it
    row = predict.predict_case(Case(MLP, "inplace_relu", "train", 2, "cuda", data="synthetic"))
    assert row["status"] == "unsupported" and "ReLU" in row["message"] and row["predicted_bytes"] is None


def test_predict_counts_cudnn_workspaces_on_the_gpu_they_were_measured_on_and_says_where_not():
    captcha = Case("captcha_resnet18", "baseline", "eval", 8, "cuda", data="synthetic")
    hopper = predict.predict_case(captcha, capability=(9, 0))
    # the workspace at the peak is the 512-channel 3x3 convolution's at batch 8, as the H200 held it
    assert hopper["cudnn_workspace_bytes"] == 10_175_488 and "measured on an NVIDIA H200" in hopper["message"]
    ampere = predict.predict_case(captcha, capability=(8, 0))
    assert ampere["cudnn_workspace_bytes"] == 0
    assert "not modelled" in ampere["message"] and "not 8.0" in ampere["message"]
    mlp = predict.predict_case(Case(MLP, "baseline", "eval", 2, "cuda", data="synthetic"), capability=(9, 0))
    assert mlp["cudnn_workspace_bytes"] is None and "cuDNN" not in mlp["message"]  # no convolution


@pytest.mark.slow  # among the longest of make test: CI runs it in its step of long tests (.ci/run)
def test_predict_plans_a_checkpoint_budget_on_predictions_and_predicts_compile_on_fake_tensors():
    planned = predict.predict_case(Case(MLP, "checkpoint:budget=1.0", "train", 8, "cuda", data="synthetic"))
    assert planned["status"] == "ok" and "plan chosen on predicted peaks" in planned["message"], planned
    baseline = predict.predict_case(Case(MLP, "baseline", "train", 8, "cuda", data="synthetic"))
    assert planned["predicted_bytes"] <= baseline["predicted_bytes"]
    refused = predict.predict_case(Case(MLP, "checkpoint:budget=0.01", "train", 8, "cuda", data="synthetic"))
    assert refused["status"] == "unsupported" and "no plan can fit" in refused["message"], refused  # under the state
    compiled = predict.predict_case(Case(MLP, "compile:backend=aot_eager_decomp_partition", "train", 8, "cuda",
                                         data="synthetic"))
    assert compiled["status"] == "ok" and compiled["engine"] != "cpu", compiled  # compiled on fake tensors
    inductor = predict.predict_case(Case(MLP, "compile", "train", 8, "cuda", data="synthetic"))
    assert inductor["status"] == "ok" and "from its generated code" in inductor["message"], inductor


def test_fit_on_cuda_without_a_gpu_searches_on_predictions_and_says_they_are_unconfirmed(monkeypatch):
    # each attempt is predict's allocated figure (here a line: 100 MiB of model state, 30 MiB per sample); the
    # answer is the largest batch under the budget, not verified, with no real run counted and nothing timed
    asked = []

    def predicted(case, capability=None):
        asked.append(case.batch_size)
        assert case.device == "cuda"
        return 100 * MIB + 30 * MIB * case.batch_size

    monkeypatch.setattr(fake_engine, "has_gpu", lambda: False)
    monkeypatch.setattr(predict, "predicted_allocated", predicted)
    [baseline] = analysis.fit([], 1000 * MIB, device="cuda", workload=MLP, max_batch=1000)
    assert baseline.batch_size == 30 and baseline.peak_bytes == 1000 * MIB and not baseline.verified
    assert baseline.runs == 0 and baseline.time_per_sample_ms is None and "not confirmed" in baseline.note
    assert baseline.next_batch_peak_bytes == 1030 * MIB and "predicted on fake CUDA" in baseline.next_batch_method
    assert len(asked) <= 12


def test_predict_gpu_says_when_a_case_fits_only_in_the_headroom_plan_keeps():
    """The 70B job on 5 H100s judged 79.5 GiB: within the card's 80 GiB, not within plan's 76 GiB (5% headroom);
    predict --gpu says both, so that it and plan do not seem to disagree."""
    from bench.cli.commands_analysis import _fits_on
    from bench.core import gpus

    h100 = gpus.find_gpu("H100 80GB")
    gib, context = 2**30, gpus.CUDA_CONTEXT_BYTES
    rows = [{"strategy": name, "phase": "train", "batch_size": 8,
             "predicted_reserved_bytes": None if judged is None else int(judged * gib) - context}
            for name, judged in (("a", 62.8), ("b", 79.5), ("c", 87.3), ("d", None))]
    lines = _fits_on(h100, rows).splitlines()[2:]
    assert lines[0].endswith("62.8 GiB fits")
    assert "79.5 GiB fits, but in the last 5% of the card, which plan keeps free by default" in lines[1]
    assert lines[2].endswith("87.3 GiB does not fit") and len(lines) == 3
