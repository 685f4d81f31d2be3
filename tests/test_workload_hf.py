"""The `hf:` workload: presets that reach transformers' configurations, options and their errors, local config files,
batches, checkpoint units, verification against the baseline, exact prediction at small size, and the missing extra.

Small: full-size models are built on the meta device only (no memory, milliseconds); measured runs use one or two
layers, sequences of 8-16 tokens and batches of 1-2. The tests that need transformers are skipped only where it is
not installed; `make install` installs the `hf` extra, so they run in CI.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.analysis import fake_engine
from bench.cli.main import main
from bench.core.errors import UsageError
from bench.run.case import Case, bind_case
from bench.run.runner import memory_pass, run_case
from strategies.checkpoint import UnitCheckpointer
from workloads.framework.hf_presets import PRESETS, PUBLISHED_PARAMETERS
from workloads.framework.loader import resolve_workload

needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                              reason="transformers is not installed (make install installs membench[hf])")

ROOT = Path(__file__).resolve().parent.parent
# the configuration attribute that holds each number, whatever the preset's own key (gpt2: n_embd, n_head, ...)
SHAPE_KEYS = {"hidden_size": ("hidden_size", "n_embd"), "num_attention_heads": ("num_attention_heads", "n_head"),
              "num_key_value_heads": ("num_key_value_heads",), "vocab_size": ("vocab_size",),
              "intermediate_size": ("intermediate_size",), "num_hidden_layers": ("num_hidden_layers", "n_layer")}

pytestmark = pytest.mark.usefixtures("one_thread")


def on_meta(spec):
    """(workload, model built on the meta device): shapes only, at any size."""
    workload = resolve_workload(spec)
    with torch.device("meta"):
        return workload, workload.build_model()


def train_step(workload, model, batch_size=2):
    """One forward, loss and backward on a synthetic batch; the loss."""
    inputs, target = workload.make_batch(batch_size, "synthetic")
    model.train()
    loss = workload.loss(workload.run_model(model, inputs).float(), target)
    loss.backward()
    return loss


def cpu_case(spec, strategy="baseline", batch=1, phase="train"):
    return Case(spec, strategy, phase, batch, "cpu", data="synthetic", warmup=0, steps=1)


# --- presets -----------------------------------------------------------------------------------------------

@needs_hf
@pytest.mark.parametrize("preset", sorted(PUBLISHED_PARAMETERS))
def test_a_preset_builds_at_full_size_with_its_published_numbers_and_parameter_count(preset):
    workload, model = on_meta(f"hf:{preset}")
    config = model.config
    for attribute, keys in SHAPE_KEYS.items():
        published = next((PRESETS[preset][key] for key in keys if key in PRESETS[preset]), None)
        if published is not None:
            assert getattr(config, attribute) == published, attribute
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMETERS[preset]
    assert next(model.parameters()).dtype == torch.float32 and config.use_cache is False
    assert len(workload.checkpoint_units(model)) == config.num_hidden_layers == workload.checkpoint_unit_count()


@needs_hf
@pytest.mark.parametrize("preset", sorted(PUBLISHED_PARAMETERS))
def test_layers_keeps_every_other_number(preset):
    full_workload, full = on_meta(f"hf:{preset}")
    workload, model = on_meta(f"hf:{preset}:layers=1")
    assert len(workload.checkpoint_units(model)) == model.config.num_hidden_layers == 1
    for attribute in ("hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size", "intermediate_size"):
        assert getattr(model.config, attribute, None) == getattr(full.config, attribute, None), attribute
    assert workload.describe()["hidden_size"] == full.config.hidden_size


@needs_hf
def test_the_published_details_reach_the_models():
    _, llama = on_meta("hf:llama-3.1-8b:layers=1")
    assert llama.config.rope_parameters["rope_type"] == "llama3" and llama.config.rope_parameters["factor"] == 8.0
    assert llama.model.layers[0].self_attn.k_proj.weight.shape == (8 * 128, 4096)  # 8 kv heads of 128
    _, small_llama = on_meta("hf:llama-3.2-1b:layers=1")
    assert small_llama.lm_head.weight is small_llama.model.embed_tokens.weight  # tied in 3.2-1B, not in 3.1-8B
    assert llama.lm_head.weight is not llama.model.embed_tokens.weight
    _, qwen = on_meta("hf:qwen2.5-7b:layers=1")
    assert qwen.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's q, k, v biases
    _, bert = on_meta("hf:bert-base-uncased:layers=1")
    assert type(bert).__name__ == "BertForMaskedLM"


# --- options and their errors ------------------------------------------------------------------------------

@needs_hf
def test_options_reach_the_model():
    workload = resolve_workload("hf:tiny-llama:layers=1:seq_len=8:attn=eager")
    assert workload.spec() == "hf:tiny-llama:layers=1:seq_len=8:attn=eager"
    model = workload.build_model()
    assert model.config._attn_implementation == "eager" and len(model.model.layers) == 1
    assert workload.make_batch(2)[0]["input_ids"].shape == (2, 8)
    assert resolve_workload("hf:gpt2").task == "causal_lm" and resolve_workload("hf:tiny-bert").task == "masked_lm"
    assert resolve_workload("hf:tiny-bert:task=seq_cls").build_model().__class__.__name__ == \
        "BertForSequenceClassification"


@needs_hf
@pytest.mark.parametrize("spec,words", [
    ("hf:gtp2", ["'gtp2'", "did you mean gpt2", "llama-3.1-8b", "path/to/config.json"]),
    ("hf:gpt2:attn=flash", ["'flash'", "sdpa, eager"]),
    ("hf:gpt2:task=masked_lm", ["'masked_lm'", "auto, causal_lm"]),
    ("hf:tiny-bert:task=causal_lm", ["'causal_lm'", "auto, masked_lm, seq_cls"]),
    ("hf:gpt2:layers=13", ["layers=13", "between 1 and 12"]),
    ("hf:gpt2:seq_len=1025", ["seq_len=1025", "between 1 and 1024"]),
    ("hf:gpt2:seq_len=0", ["seq_len=0", "between 1 and 1024"]),
    ("hf:gpt2:layers=two", ["layers"]),
    ("hf:gpt2:heads=2", ["heads"]),
    ("hf:gpt2:loss=labels", ["'labels'", "logits, model"]),
])
def test_a_bad_option_is_one_line_naming_the_value_and_the_choices(spec, words):
    with pytest.raises(UsageError) as error:
        resolve_workload(spec)
    message = str(error.value)
    assert all(word in message for word in words) and "\n" not in message, message


@needs_hf
def test_a_bad_option_exits_2_from_the_command_line(capsys):
    assert main(["compare", "--workload", "hf:gpt2:attn=flash", "--strategies", "checkpoint", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "'flash'" in err and "sdpa, eager" in err and "\n" not in err


# --- a local config.json -----------------------------------------------------------------------------------

@needs_hf
def test_a_local_config_file_or_folder_is_read(tmp_path):
    folder = tmp_path / "my-llama"
    folder.mkdir()
    published = {**PRESETS["tiny-llama"], "torch_dtype": "bfloat16", "hidden_size": 48, "transformers_version": "x"}
    (folder / "config.json").write_text(json.dumps(published))
    for spec in (f"hf:{folder / 'config.json'}:layers=1", f"hf:{folder}:layers=1"):
        workload = resolve_workload(spec)
        assert workload.spec() == spec and workload.task == "causal_lm"
        model = workload.build_model()
        assert model.config.hidden_size == 48 and len(model.model.layers) == 1
        assert next(model.parameters()).dtype == torch.float32  # the file's torch_dtype is left to strategies


@needs_hf
@pytest.mark.parametrize("content,words", [
    (None, ["does not exist"]),
    ("{not json", ["not a readable JSON file"]),
    ('{"hidden_size": 8}', ["no 'model_type'"]),
    ('{"model_type": "no-such-model"}', ["'no-such-model'", "not known to transformers"]),
])
def test_a_bad_config_file_is_one_line(tmp_path, content, words):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UsageError) as error:
        resolve_workload(f"hf:{path}")
    assert all(word in str(error.value) for word in words) and "\n" not in str(error.value), error.value


# --- data --------------------------------------------------------------------------------------------------

@needs_hf
@pytest.mark.parametrize("data", ["text", "synthetic"])
def test_causal_batches_are_deterministic_next_token_pairs(data):
    workload = resolve_workload("hf:gpt2:layers=1:seq_len=16")
    (inputs, target), (again, again_target) = workload.make_batch(3, data), workload.make_batch(3, data)
    ids = inputs["input_ids"]
    assert ids.shape == target.shape == (3, 16) and ids.dtype == target.dtype == torch.int64
    assert torch.equal(ids, again["input_ids"]) and torch.equal(target, again_target)
    assert torch.equal(ids[:, 1:], target[:, :-1])
    assert 0 <= int(ids.min()) and int(ids.max()) < 50257
    workload.seed = 1
    assert not torch.equal(workload.make_batch(3, data)[0]["input_ids"], ids)


@needs_hf
def test_text_tokens_are_pairs_of_source_bytes():
    from workloads import hf
    from workloads.framework import text_data

    ids = hf.token_windows(2, 8, vocab_size=65536, seed=0)  # a vocabulary as large as every pair: no wrap-around
    text = b"".join(int(i).to_bytes(2, "big") for i in ids[0])
    assert text in bytes(text_data.stdlib_corpus().tolist())
    assert int(hf.token_windows(2, 8, vocab_size=512, seed=0).max()) < 512


@needs_hf
def test_masked_lm_batches_predict_a_share_of_masked_positions():
    workload = resolve_workload("hf:bert-base-uncased:layers=1:seq_len=20")
    inputs, target = workload.make_batch(2, "text")
    masked = target != -100
    assert masked.sum(dim=1).tolist() == [3, 3]  # 15% of 20
    assert (inputs["input_ids"][masked] == 103).all()  # bert-base-uncased's [MASK]
    assert (inputs["input_ids"][~masked] != 103).any()
    labels = resolve_workload("hf:tiny-bert:task=seq_cls").make_batch(4)[1]
    assert labels.shape == (4,) and int(labels.max()) < 2


# --- loss=model: the model's own loss from labels= ----------------------------------------------------------

@needs_hf
@pytest.mark.parametrize("spec", ["hf:tiny-gpt2:seq_len=8", "hf:tiny-llama:seq_len=8:packed=2",
                                  "hf:tiny-bert:seq_len=8", "hf:tiny-bert:seq_len=8:task=seq_cls"])
def test_loss_model_is_the_models_own_loss_on_labels(spec):
    """The batch holds `labels` (a causal LM's a copy of its input ids, one storage in the inputs and as the
    target); the step returns the model's own loss, which is the workload's cross-entropy on the same predictions."""
    own, ours = resolve_workload(f"{spec}:loss=model"), resolve_workload(spec)
    assert own.spec() == f"{spec}:loss=model" and ours.settings["loss"] == "logits"
    inputs, target = own.make_batch(2, "synthetic")
    plain_inputs, plain_target = ours.make_batch(2, "synthetic")
    assert inputs["labels"] is target
    assert torch.equal(inputs["input_ids"], plain_inputs["input_ids"])
    model = own.build_model()
    model.eval()  # no dropout: the two losses see the same logits
    loss = own.loss(own.run_model(model, inputs), target)
    assert loss.dim() == 0 and loss.requires_grad
    logits = ours.run_model(model, plain_inputs)
    if own.task == "causal_lm":  # transformers shifts the labels: the last position predicts nothing
        assert target.untyped_storage().data_ptr() != inputs["input_ids"].untyped_storage().data_ptr()
        expected = ours.loss(logits[:, :-1], plain_target[:, :-1])
        if own.settings["packed"]:  # a document's last token predicts nothing, in both
            assert (target[:, 1:] == -100).tolist() == (plain_target[:, :-1] == -100).tolist()
    else:
        assert torch.equal(target, plain_target)
        expected = ours.loss(logits, plain_target)
    torch.testing.assert_close(loss, expected)


@needs_hf
def test_loss_model_has_no_head_to_chunk():
    assert resolve_workload("hf:tiny-gpt2:seq_len=8").has_output_head()
    assert not resolve_workload("hf:tiny-gpt2:seq_len=8:loss=model").has_output_head()
    row = run_case(cpu_case("hf:tiny-gpt2:seq_len=8:loss=model", "chunked_loss"))
    assert row["status"] == "unsupported" and "output head" in row["message"]


# --- training, checkpoint units, verification ----------------------------------------------------------------

@needs_hf
@pytest.mark.parametrize("spec", ["hf:tiny-gpt2:seq_len=8", "hf:tiny-llama:seq_len=8", "hf:tiny-bert:seq_len=8",
                                  "hf:tiny-bert:seq_len=8:task=seq_cls", "hf:tiny-gpt2:seq_len=8:loss=model"])
def test_checkpointing_each_layer_leaves_loss_and_gradients_unchanged(spec):
    workload = resolve_workload(spec)
    plain, checkpointed = workload.build_model(), workload.build_model()
    units = workload.checkpoint_units(checkpointed)
    assert len(units) == 2 and workload.units_chain is False
    checkpointer = UnitCheckpointer(checkpointed)
    for unit in units:
        checkpointer.install([unit])
    torch.manual_seed(1)  # the same dropout masks (checkpoint replays them in its recompute)
    expected = train_step(workload, plain)
    torch.manual_seed(1)
    got = train_step(workload, checkpointed)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)


@needs_hf
@pytest.mark.parametrize("spec", ["hf:tiny-gpt2:seq_len=8", "hf:tiny-llama:seq_len=8"])
@pytest.mark.parametrize("strategy", ["baseline", "checkpoint"])
def test_baseline_and_checkpoint_verify(spec, strategy):
    # the architectures of gpt2 and the llama presets at tiny width: a whole run (timing, verification, memory)
    # of gpt2's real width takes ~20 s here, most of it AdamW over its 50,257 x 768 embedding
    row = run_case(cpu_case(spec, strategy), env={})
    assert row["status"] == "ok" and row["matches_baseline"] is True, row["message"]


# --- packed rows ---------------------------------------------------------------------------------------------

@needs_hf
def test_packed_rows_restart_positions_and_attend_within_each_document():
    workload = resolve_workload("hf:tiny-llama:seq_len=10:packed=3")  # documents of 3, 3 and 4 tokens
    inputs, target = workload.make_batch(2, "synthetic")
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 0, 1, 2, 3]] * 2
    assert (target[:, [2, 5]] == -100).all() and (target[:, [0, 1, 3, 4, 6, 7, 8, 9]] != -100).all()
    model = workload.build_model()
    changed = dict(inputs, input_ids=inputs["input_ids"].clone())
    changed["input_ids"][:, 0] = (changed["input_ids"][:, 0] + 1) % 512  # the first document's first token
    with torch.no_grad():
        moved = (workload.run_model(model, inputs) - workload.run_model(model, changed)).abs().amax(-1)
    assert (moved[:, :3] > 0).all() and (moved[:, 3:] == 0).all()  # the other documents never see it
    # the mask is batch x sequence^2 on top of the unpacked step (peak in backward, CPU exact count)
    peaks = {spec: memory_pass(cpu_case(spec, batch=2), bind_case(cpu_case(spec, batch=2))[0])["peak_mem_bytes"]
             for spec in ("hf:tiny-llama:seq_len=64", "hf:tiny-llama:seq_len=64:packed=4")}
    assert peaks["hf:tiny-llama:seq_len=64:packed=4"] - peaks["hf:tiny-llama:seq_len=64"] >= 2 * 64 * 64
    for bad in ("hf:tiny-llama:seq_len=8:packed=1", "hf:tiny-llama:seq_len=8:packed=9",
                "hf:tiny-bert:seq_len=8:packed=2"):
        with pytest.raises(UsageError, match="packed="):
            resolve_workload(bad)


# --- prediction, exact at small size -------------------------------------------------------------------------

@needs_hf
@pytest.mark.parametrize("spec", ["hf:gpt2:layers=2:seq_len=8", "hf:tiny-llama:seq_len=8",
                                  "hf:tiny-llama:seq_len=8:attn=eager", "hf:tiny-bert:seq_len=8",
                                  "hf:tiny-llama:seq_len=8:packed=2", "hf:tiny-llama:seq_len=8:loss=model"])
def test_the_fake_engine_predicts_the_cpu_count_to_the_byte(spec):
    case = cpu_case(spec)
    measured = memory_pass(case, bind_case(case)[0])["peak_mem_bytes"]
    assert fake_engine.tracked_peak(case, "baseline", engine="fake", block_bytes=1) == measured


@needs_hf
def test_the_step_runs_on_the_meta_device():
    # the plan meter (checkpoint's budget=) and predict's meta engine run the step on meta: no value is read
    workload, model = on_meta("hf:llama-3.1-8b:layers=1:seq_len=16")
    inputs, _ = workload.make_batch(1)
    logits = workload.run_model(model, {k: v.to("meta") for k, v in inputs.items()})
    assert logits.shape == (1, 16, 128256) and logits.is_meta


# --- without transformers ----------------------------------------------------------------------------------

def test_without_transformers_the_workload_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails as if not installed
    with pytest.raises(UsageError) as error:
        resolve_workload("hf:gpt2")
    message = str(error.value)
    assert "pip install 'membench[hf]'" in message and "\n" not in message
    assert main(["compare", "--workload", "hf:gpt2", "--strategies", "checkpoint", "--device", "cpu"]) == 2
    assert "pip install 'membench[hf]'" in capsys.readouterr().err


def test_the_module_imports_without_transformers():
    code = ("import sys; sys.modules['transformers'] = None; import workloads.hf; "
            "from workloads import WORKLOADS; assert 'hf' in WORKLOADS")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@needs_hf
@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")
@pytest.mark.slow  # among the longest of make test: CI runs it in its step of long tests (.ci/run)
def test_building_an_hf_model_logs_nothing_of_torchao():
    # transformers imports torchao where installed; its import warned of each CUDA kernel a CPU build cannot load
    # and torch of its enum registrations, on every hf: run
    code = ("from workloads import get_workload; get_workload('hf:gpt2:layers=1:seq_len=8').build_model(); "
            "import strategies.optimizer as o; o.low_bit_class('adamw8bit')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "torchao" not in done.stderr and "register_constant" not in done.stderr, done.stderr
