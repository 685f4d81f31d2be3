"""`hf:<preset>`, `hf:path/to/config.json`, `hf:org/name`: a Hugging Face transformers model, random weights.

The model is built from transformers' configuration classes: from a preset's published numbers
(`workloads.framework.hf_presets`: gpt2, bert-base-uncased, llama-3.2-1b, llama-3.1-8b, mistral-7b, qwen2.5-7b, and
small `tiny-*` shapes), from the `config.json` of a model folder the user has, read locally, or from a Hub model's
`config.json` by its id (`hf:Qwen/Qwen2.5-7B-Instruct`, `@revision` after it), read through huggingface_hub from the
user's cache or the Hub (`workloads.framework.hf_config`). Weights come from the model's own initialisation, seeded; no
tokenizer and no weights are ever needed, and a preset or a local file needs no Hub access.

Options (`hf:llama-3.2-1b:layers=2:seq_len=256:attn=eager`):
- `layers`: the number of decoder/encoder layers (0: the model's own), to measure a big model's step on a CPU;
- `seq_len`: tokens per sequence (at most the model's `max_position_embeddings`);
- `attn`: transformers' `attn_implementation`, `sdpa` (the default) or `eager`;
- `trust_remote_code`: `true` to build an architecture transformers does not have from the repository's own code
  (its config's `auto_map`), which is then imported and run, as transformers' `trust_remote_code=True` does;
- `task`: `causal_lm` for decoders; `masked_lm` or `seq_cls` (sequence classification, the config's
  `num_labels` classes) for encoders; `auto` picks the first of these that the architecture has;
- `packed`: causal LM only, documents packed into each row of `seq_len` tokens (0: not packed; N >= 2: N
  documents of equal length, the last taking the rest), as torchtune's and TRL's packing makes them: the position ids
  restart at each document (`position_ids` passed to the model), the last token of a document predicts nothing, and
  transformers' `sdpa` and `eager` attention see the documents apart through its block-diagonal causal mask (one
  batch x sequence x sequence mask, which SDPA takes as an attention bias: no flash kernel on CUDA);
- `loss`: `logits` (the default), the loss computed here from the logits (below); or `model`, the model's own loss
  from `labels=`, as transformers' Trainer and most training scripts compute it: the batch holds `labels` (for a
  causal LM a copy of the input ids, which transformers' `ForCausalLMLoss` pads and shifts; for a packed row -100 at
  each later document's first token; the masked-LM or class targets otherwise), the model returns the loss and the
  step drops its logits there, as the Trainer's `compute_loss` does. The loss is the same cross-entropy, but for a
  causal LM over one position fewer per row (the last predicts nothing: its next token is not in the row);
  or `shifted`, causal LM only, the loss as transformers' models computed it from `labels=` before 4.46 (GPT-2's
  `lm_logits[..., :-1, :].contiguous()` against `labels[..., 1:]`, nn.CrossEntropyLoss) and as training scripts of
  that time wrote it (ColossalAI's GPTLMLoss): in the logits' own dtype, with no float32 copy, over a contiguous copy
  of all positions but the last; computed in the step from the batch's `labels` (as for `model`), the logits dropped
  before the backward. Every other choice runs the loss in float32 (the session converts the output; transformers'
  `ForCausalLMLoss` calls `logits.float()` since 4.46), whose log-softmax and its two gradients are each twice the
  16-bit logits' bytes.

Data: `text`, the standard library's source (`workloads.framework.text_data`) mapped into the vocabulary without a
tokenizer: each token is two consecutive bytes, `(256 * first + second) % vocab_size`, deterministic; or
`synthetic`, token ids drawn uniformly from the vocabulary with the workload's seed. The loss is computed here
(unless `loss=model` or `shifted`), not by transformers, so that `loss(output, target)` gets the logits like any
workload: causal LM, cross-entropy against the next token (what transformers' `labels=` computes after its shift);
masked LM, 15% of each sequence's positions replaced by the mask token and predicted (-100 elsewhere, as
transformers' data collator marks them); classification, one label per sequence.

Checkpoint units: the model's decoder/encoder layers (the ModuleList of `num_hidden_layers` blocks). They do not
chain in membench's sense (the model passes each one the attention mask and rotary embeddings as arguments), so
each is checkpointed on its own.

Limitations: float32 weights (the published `torch_dtype` is left to strategies); `use_cache` is off (a training
step keeps no key/value cache); no padding, no attention mask (every sequence is full length). Packed rows run
transformers' masked attention; sources that pack with FlexAttention's block mask (torchtune) or flash-attention's
variable-length kernel keep no sequence x sequence mask, which a prediction says (`prediction_note`).
transformers is an optional dependency (`membench[hf]`): this module imports without it, and naming the workload
then says, in one line, how to install it.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from bench.core.errors import UsageError
from workloads import DeferredHead, Trait, Workload, register_workload
from workloads.framework import hf_checks, hf_moe, text_data
from workloads.framework.hf_config import (  # noqa: F401
    FILE_FORM, REMOTE_TASK_CLASSES, config_values, is_file_reference, make_config, read_config_file, remote_class,
    remote_tasks, resolve_config,
)
from workloads.framework.hf_presets import MASK_TOKEN_IDS, PRESETS
from workloads.framework.transformers_import import import_transformers  # noqa: F401 - membench.hf imports it here

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")
TASKS = ("causal_lm", "masked_lm", "seq_cls")
# the loss computed here from the logits, the model's own from labels=, or transformers' of before 4.46 (in the
# logits' dtype, over a shifted contiguous copy), computed in the step
LOSSES = ("logits", "model", "shifted")
MASKED_FRACTION = 0.15  # BERT's: the share of positions a masked-LM batch predicts
IGNORE_INDEX = -100  # transformers' label for positions without a loss

def _auto_classes(transformers) -> dict[str, Any]:
    """task -> (transformers' Auto class, its mapping from model_type to architecture name)."""
    from transformers.models.auto import modeling_auto as auto

    return {"causal_lm": (transformers.AutoModelForCausalLM, auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
            "masked_lm": (transformers.AutoModelForMaskedLM, auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES),
            "seq_cls": (transformers.AutoModelForSequenceClassification,
                        auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)}


def packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor:
    """transformers' `find_packed_sequence_indices` without its host-side check of whether any row is packed (the
    workload knows its rows are): the document index of each position, where position ids stop counting up by 1."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


@contextlib.contextmanager
def sequences_not_packed(packed: bool = False) -> Iterator[None]:
    """Inside, transformers' causal masks take every batch row as one sequence, without looking at the data.

    Given no attention mask, transformers 5 checks the position ids for several sequences packed into one row
    (`masking_utils.find_packed_sequence_indices`): `(...).all()` on a tensor, a host-side read of its value. On the
    meta device that read fails; on fake tensors (predict's engines) it is skipped and the check answers "packed",
    so a full (batch, 1, seq, seq) mask is built where the CPU and CUDA run SDPA with `is_causal` and no mask. This
    workload's rows are never packed (positions 0..seq_len-1 in each), so the answer is given instead of read: the
    step is the same on the CPU, on meta and on fake tensors, and what it runs is what transformers runs on a real
    unpadded batch. With `packed` the rows are packed, and the answer is the documents' indices, computed on any
    device (`packed_sequence_indices`). Restored on exit; a transformers without that function is left alone."""
    masking_utils = sys.modules.get("transformers.masking_utils")
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = packed_sequence_indices if packed else lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def tasks_of(transformers, model_type: str) -> list[str]:
    """The tasks a model type supports here: causal LM for decoders, masked LM and classification for encoders."""
    classes = _auto_classes(transformers)
    if model_type in classes["masked_lm"][1]:  # an encoder (BERT also has a causal head, as a decoder: not ours)
        return [task for task in ("masked_lm", "seq_cls") if model_type in classes[task][1]]
    return ["causal_lm"] if model_type in classes["causal_lm"][1] else []


def token_windows(batch_size: int, tokens: int, vocab_size: int, seed: int) -> torch.Tensor:
    """`batch_size` windows of `tokens` token ids from the standard library's source, at seeded offsets: each id
    two consecutive bytes, `(256 * first + second) % vocab_size`."""
    inputs, target = text_data.next_token_windows(batch_size, 2 * tokens - 1, seed)
    data = torch.cat([inputs, target[:, -1:]], dim=1).view(batch_size, tokens, 2)
    return (256 * data[..., 0] + data[..., 1]) % vocab_size


def shifted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A causal LM's loss as transformers' GPT-2 computed it from `labels=` before 4.46 (and ColossalAI's GPTLMLoss
    of 2022): the logits of all positions but the last copied contiguous, cross-entropy against the labels shifted by
    one, in the logits' own dtype (no float32 copy: a 16-bit model's log-softmax and its gradients are 16-bit)."""
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous()
    return F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1),
                           ignore_index=IGNORE_INDEX)


# --- the workload --------------------------------------------------------------------------------------------

@register_workload
class HfWorkload(Workload):
    """A transformers model from a preset's or a config file's numbers, random weights; AdamW as HF's Trainer."""

    name = "hf"
    description = ("a Hugging Face transformers model (hf:<preset>, hf:path/to/config.json or hf:org/name from the "
                   "Hub, its config.json only), random weights, "
                   "stdlib source text as tokens, cross-entropy, AdamW")
    default_batch_size = 4
    seed = 0
    data_sources = ("text", "synthetic")
    positional_option = "model"
    options = {"model": "gpt2", "layers": 0, "seq_len": 128, "attn": "sdpa", "task": "auto", "packed": 0,
               "loss": "logits", "trust_remote_code": False}
    units_chain = False  # each layer gets the attention mask and rotary embeddings as arguments besides its input
    learning_rate = 5e-5  # transformers' Trainer defaults: AdamW, lr 5e-5, no weight decay
    weight_decay = 0.0
    small = ("hf:tiny-llama:seq_len=16", 2)  # the llama presets' architecture at a tiny width; dict inputs
    # not in the fake-CUDA grid: tests_cuda_fake/test_hf_full_size.py runs the presets at full size there
    small_for = {"peak_in_backward": ("hf:tiny-llama:seq_len=16", 4), "emulated16": ("hf:tiny-llama:seq_len=16", 1),
                 "fake_cuda": None}
    requires = "transformers"
    declared_traits = frozenset({Trait.TRANSFORMERS_MODEL})  # every model it builds is a transformers architecture

    def configure(self) -> None:
        s = self.settings
        transformers = import_transformers()  # here, so that a missing extra or a bad value fails before any run
        if s["attn"] not in ATTENTION_IMPLEMENTATIONS:
            raise UsageError(f"unknown hf attn {s['attn']!r}; valid choices: {', '.join(ATTENTION_IMPLEMENTATIONS)}")
        if s["loss"] not in LOSSES:
            raise UsageError(f"unknown hf loss {s['loss']!r}; valid choices: {', '.join(LOSSES)}")
        self.config_source = resolve_config(str(s["model"]), transformers, bool(s["trust_remote_code"]))
        values = self.config_source.values
        source = str(s["model"])
        hf_checks.check_values(values, source, transformers)
        full = make_config(transformers, values, 0, source, self.config_source)
        if s["layers"] < 0 or s["layers"] > full.num_hidden_layers:
            raise UsageError(f"hf:{s['model']}:layers={s['layers']} must be between 1 and "
                             f"{full.num_hidden_layers} (the model's own; 0 for all)")
        self.model_type = values["model_type"]
        tasks = (remote_tasks(values) if self.config_source.remote_code else tasks_of(transformers, self.model_type))
        if not tasks:
            raise UsageError(f"hf: model_type {self.model_type!r} has no causal or masked language-model class in "
                             f"transformers {transformers.__version__}")
        if s["task"] != "auto" and s["task"] not in tasks:
            raise UsageError(f"unknown task {s['task']!r} for hf:{s['model']} ({self.model_type}); valid choices: "
                             f"{', '.join(['auto', *tasks])}")
        self.task = tasks[0] if s["task"] == "auto" else s["task"]
        if s["loss"] == "shifted" and self.task != "causal_lm":
            raise UsageError(f"hf:{s['model']}:loss=shifted is a causal LM's loss (this task: {self.task}); valid "
                             f"choices: logits, model")
        self._values = values
        if hf_moe.is_moe(full):  # its experts' grouped products on meta and fake tensors (workloads.framework.hf_moe)
            hf_moe.register_grouped_mm_meta_kernel()
        hf_checks.check_size(values, self.task, s["layers"] or full.num_hidden_layers, source, lambda layers: (
            self._model_builder()(make_config(transformers, values, layers, source, self.config_source),
                                  dtype=torch.float32)))
        positions = getattr(full, "max_position_embeddings", None)
        if s["seq_len"] < 1 or (positions and s["seq_len"] > positions):
            raise UsageError(f"hf:{s['model']}:seq_len={s['seq_len']} must be between 1 and {positions} "
                             "(the model's max_position_embeddings)")
        if s["packed"] and (self.task != "causal_lm" or not 2 <= s["packed"] <= s["seq_len"]):
            raise UsageError(f"hf:{s['model']}:packed={s['packed']} must be 0 (not packed) or between 2 and seq_len "
                             f"({s['seq_len']}) documents per row, for a causal LM (this task: {self.task})")

    def config(self):
        """The transformers configuration this workload builds its model from (a new object each call)."""
        return make_config(import_transformers(), self._values, self.settings["layers"],
                           config_source=self.config_source)

    def _model_builder(self):
        """What builds the model from a configuration, `builder(config, **options)`: the `from_config` of
        transformers' Auto class of the task, or for remote code the user trusted the `_from_config` of the
        repository's own class for it, as transformers' Auto classes call it."""
        if self.config_source.remote_code:
            return remote_class(self.config_source, REMOTE_TASK_CLASSES[self.task])._from_config
        return _auto_classes(import_transformers())[self.task][0].from_config

    def build_model(self) -> nn.Module:
        build = self._model_builder()
        torch.manual_seed(self.seed)
        model = build(self.config(), attn_implementation=self.settings["attn"], dtype=torch.float32)
        return hf_moe.file_moe_allocations(model)  # an MoE model's router and dispatch filed apart; else unchanged

    @property
    def model_loss(self) -> bool:
        """Whether the step computes the loss from the batch's `labels`, the logits dropped in it (`loss=model`, the
        model's own; `loss=shifted`, transformers' of before 4.46)."""
        return self.settings["loss"] in ("model", "shifted")

    def run_model(self, model: nn.Module, inputs) -> torch.Tensor:
        """The logits: transformers' models return a ModelOutput, the loss is computed here (see `loss`). With
        `loss=model` the model's own loss (the batch holds `labels`): the ModelOutput, and the logits in it, are
        dropped here, as the Trainer's `compute_loss` drops them. With `loss=shifted` the same, the loss computed
        here from the logits as transformers computed it before 4.46 (`shifted_cross_entropy`)."""
        if self.settings["loss"] == "shifted":
            labels = inputs["labels"]
            with sequences_not_packed(bool(self.settings["packed"])):
                logits = model(**{key: value for key, value in inputs.items() if key != "labels"}).logits
            return shifted_cross_entropy(logits, labels)
        with sequences_not_packed(bool(self.settings["packed"])):
            output = model(**inputs)
        if self.model_loss:
            return output.loss
        return output.logits if hasattr(output, "logits") else output

    def make_batch(self, batch_size: int, data: str = "text") -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        config, seq_len = self.config(), self.settings["seq_len"]
        causal = self.task == "causal_lm"
        tokens = seq_len + 1 if causal else seq_len
        gen = torch.Generator().manual_seed(self.seed)
        if self.check_data(data) == "text":
            ids = token_windows(batch_size, tokens, config.vocab_size, self.seed)
        else:
            ids = torch.randint(config.vocab_size, (batch_size, tokens), generator=gen)
        if causal and self.settings["packed"]:
            inputs, target = self._packed(ids)
        elif causal:
            inputs, target = {"input_ids": ids[:, :-1].contiguous()}, ids[:, 1:].contiguous()
        elif self.task == "seq_cls":
            inputs, target = {"input_ids": ids}, torch.randint(config.num_labels, (batch_size,), generator=gen)
        else:
            inputs, target = self._masked(ids, config.vocab_size, gen)
        return self._with_labels(inputs, target) if self.model_loss else (inputs, target)

    def _with_labels(self, inputs: dict[str, torch.Tensor], target: torch.Tensor):
        """`loss=model`: the batch with `labels`, the target itself (one tensor, in the inputs and as the target).
        A causal LM's labels are its input ids, copied (a data collator's labels are a tensor of their own), which
        transformers shifts: -100 where the workload's target is (a packed row's document ends), one place later."""
        if self.task == "causal_lm":
            labels = inputs["input_ids"].clone()
            labels[:, 1:][target[:, :-1] == IGNORE_INDEX] = IGNORE_INDEX
            target = labels
        return {**inputs, "labels": target}, target

    def _packed(self, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Rows of `packed` documents: position ids restarting at each, and no target for a document's last token
        (its next token is the next document's first)."""
        batch_size, seq_len = ids.shape[0], ids.shape[1] - 1
        documents = self.settings["packed"]
        length = seq_len // documents  # the positions are Python's: no value is read from a (fake) tensor
        starts = [min(i // length, documents - 1) * length for i in range(seq_len)]
        positions = torch.tensor([i - start for i, start in enumerate(starts)]).expand(batch_size, seq_len)
        positions = positions.contiguous()
        target = ids[:, 1:].clone()
        target[:, [d * length - 1 for d in range(1, documents)]] = IGNORE_INDEX
        return {"input_ids": ids[:, :-1].contiguous(), "position_ids": positions}, target

    def prediction_note(self) -> str | None:
        """What a prediction of a packed row does not see (the sources' own attention for packed documents), and of
        a mixture-of-experts model how its tokens reach the experts and their share of the weights (hf_moe)."""
        notes = []
        if self.settings["packed"]:
            notes.append("packed rows run transformers' block-diagonal mask (batch x sequence^2, an SDPA attention "
                         "bias); FlexAttention's block mask (torchtune) or flash-attention's variable-length kernel, "
                         "which keep no such mask, are not traced")
        config = self.config()
        if hf_moe.is_moe(config):
            notes.append(hf_moe.routing_note(config, self.model_structure()))
        return "; ".join(notes) or None

    def _masked(self, ids: torch.Tensor, vocab_size: int, gen: torch.Generator):
        """Masked-LM inputs and targets: a fixed share of each row's positions, drawn with `gen`, replaced by the
        mask token (the preset tokenizer's, else the vocabulary's last id) and predicted; -100 elsewhere."""
        batch_size, seq_len = ids.shape
        count = max(1, round(MASKED_FRACTION * seq_len))
        chosen = torch.stack([torch.randperm(seq_len, generator=gen)[:count] for _ in range(batch_size)])
        masked = torch.zeros_like(ids, dtype=torch.bool).scatter_(1, chosen, True)
        mask_id = MASK_TOKEN_IDS.get(str(self.settings["model"]), vocab_size - 1)
        inputs = ids.masked_fill(masked, mask_id)
        return {"input_ids": inputs}, ids.masked_fill(~masked, IGNORE_INDEX)

    def has_output_head(self) -> bool:
        """A causal LM's, with the loss computed here: with `loss=model` (`shifted`) the step applies the head and
        the loss itself."""
        return self.task == "causal_lm" and not self.model_loss

    def output_head(self, model: nn.Module) -> nn.Linear | None:
        """A causal LM's `lm_head` (gpt2's tied to the token embedding); None for a masked LM, whose head is a
        transform (dense, activation, LayerNorm) before the decoder, and for sequence classification."""
        head = model.get_output_embeddings() if self.task == "causal_lm" else None
        return head if isinstance(head, nn.Linear) else None

    def hidden_states(self, model: nn.Module, inputs) -> torch.Tensor:
        """The base model's last hidden state (after its final norm): what the causal LM's head takes."""
        with sequences_not_packed(bool(self.settings["packed"])):
            return model.base_model(**inputs).last_hidden_state

    def loss(self, output: torch.Tensor | DeferredHead, target: torch.Tensor) -> torch.Tensor:
        if isinstance(output, DeferredHead):  # the head and this loss computed by chunks (strategies.chunked_loss)
            return output.loss(target)
        if self.model_loss:  # the loss computed by run_model from the batch's labels (the model's own, or shifted)
            return output
        if self.task == "seq_cls":
            return F.cross_entropy(output, target)
        # reshape, not view: a strategy may hand back a non-contiguous output
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1), ignore_index=IGNORE_INDEX)

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=self.learning_rate, weight_decay=self.weight_decay)

    def checkpoint_units(self, model: nn.Module) -> list[nn.Module]:
        """The model's decoder/encoder layers: the ModuleList of `num_hidden_layers` blocks."""
        layers = getattr(getattr(model, "config", None), "num_hidden_layers", None) or self.config().num_hidden_layers
        for module in model.modules():
            if isinstance(module, nn.ModuleList) and len(module) == layers:
                return list(module)
        return []

    def checkpoint_unit_count(self) -> int:
        """The configuration's layer count: building an 8B model on the CPU to count its layers would take 32 GB."""
        return self.config().num_hidden_layers

    def definition_source(self) -> str | None:
        """The config file read (for a Hub model, `org/name@commit: path`); None for a preset."""
        source = self.config_source
        if source.kind == "hub":
            return f"{source.repo_id}@{source.revision}: {source.file}"
        return source.file

    def describe(self) -> dict[str, Any]:
        config = self.config()
        shape = {key: getattr(config, key, None) for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                             "num_key_value_heads", "intermediate_size", "vocab_size")}
        return {**self.settings, "task": self.task, "model_type": self.model_type,
                **{key: value for key, value in shape.items() if value is not None}, **self.config_source.recorded()}
