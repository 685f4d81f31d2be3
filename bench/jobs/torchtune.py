"""torchtune's recipe configurations (the YAML files `tune run` takes, with its `key=value` overrides) as a membench case.

What a torchtune recipe (lora_finetune_single_device, full_finetune_single_device, torchtune 0.6) does with each key,
as membench's spec:
- `model._component_`: the builder fixes the architecture (`torchtune.models.llama3_1.lora_llama3_1_8b` is Llama 3.1
  8B with LoRA), mapped to a membench preset or the model's Hub id (`BUILDERS`); `lora_*`/`qlora_*` builders and
  `quantize_base` give LoRA/QLoRA: `lora_attn_modules` (torchtune's `output_proj` is transformers' `o_proj`),
  `apply_lora_to_mlp` (w1/w2/w3: gate_proj/down_proj/up_proj), `apply_lora_to_output` (the output head),
  `lora_rank`, `lora_alpha`, `lora_dropout`;
- `dtype: bf16`: the whole model in bfloat16, adapters included (torchtune sets the default dtype while building):
  `bf16_weights`; QLoRA quantises those bfloat16 weights (`bf16_weights+qlora`);
- `batch_size` x `gradient_accumulation_steps` is one step's batch per device, accumulated in micro-batches of
  `batch_size` (`grad_accumulation`);
- `tokenizer.max_seq_len` the sequence length; `dataset.packed` packs rows of exactly that length (membench's
  `packed` documents per row); unpacked, each batch is padded to its longest sample, at most max_seq_len;
- `enable_activation_checkpointing`: every decoder layer (`checkpoint:segments=all`);
  `enable_activation_offloading`: torchtune's OffloadActivations (`offload_activations`);
- `compile`: each decoder layer and the loss compiled (`compile:scope=layers:loss=true`, as training.compile_model
  and compile_loss do);
- `optimizer._component_` (and `fused`, `foreach`), `optimizer_in_bwd` (`optimizer_in_backward`);
- `loss._component_`: CEWithChunkedOutputLoss (and LinearCrossEntropyLoss) compute the loss in chunks of the
  output (`chunked_loss`); torch.nn.CrossEntropyLoss over the whole logits.
"""

from __future__ import annotations

import re
from typing import Any

from bench.core.errors import UsageError
from bench.jobs.files import resolve_interpolations
from bench.jobs.job import (IGNORED, NOT_MODELLED, USED, DerivedJob, Key, Reading, hf_workload, packed_documents,
                            spec_of)
from bench.jobs.models import model_workload

KIND = "torchtune"
# a sequence length where the configuration gives none (tokenizer.max_seq_len: null, an unpacked dataset): the
# padded batch is then the data's longest sample, which no configuration states
ASSUMED_SEQ_LEN = 2048

# torchtune's model builders (the base name, without lora_/qlora_) -> the membench preset or Hub id of that
# architecture (the builder fixes it; membench builds it with transformers)
BUILDERS = {
    "llama2_7b": "meta-llama/Llama-2-7b-hf", "llama2_13b": "meta-llama/Llama-2-13b-hf",
    "llama2_70b": "meta-llama/Llama-2-70b-hf",
    "llama3_8b": "meta-llama/Meta-Llama-3-8B", "llama3_70b": "meta-llama/Meta-Llama-3-70B",
    "llama3_1_8b": "llama-3.1-8b", "llama3_1_70b": "llama-3.1-70b", "llama3_1_405b": "meta-llama/Llama-3.1-405B",
    "llama3_2_1b": "llama-3.2-1b", "llama3_2_3b": "meta-llama/Llama-3.2-3B",
    "llama3_3_70b": "meta-llama/Llama-3.3-70B-Instruct",
    "mistral_7b": "mistral-7b",
    "qwen2_5_7b_base": "qwen2.5-7b", "qwen2_5_7b_instruct": "Qwen/Qwen2.5-7B-Instruct",
    "qwen2_5_72b_instruct": "Qwen/Qwen2.5-72B-Instruct", "qwen2_5_3b": "Qwen/Qwen2.5-3B",
    "qwen2_5_1_5b_instruct": "Qwen/Qwen2.5-1.5B-Instruct", "qwen2_5_0_5b": "Qwen/Qwen2.5-0.5B",
    "gemma_2b": "google/gemma-2b", "gemma_7b": "google/gemma-7b",
    "phi3_mini": "microsoft/Phi-3-mini-4k-instruct",
}
# torchtune's projection names -> transformers' module names (LoRA targets)
ATTENTION_MODULES = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")  # torchtune's w1, w3, w2
CHUNKED_LOSSES = ("torchtune.modules.loss.CEWithChunkedOutputLoss", "torchtune.modules.loss.LinearCrossEntropyLoss")
WHOLE_LOSSES = ("torch.nn.CrossEntropyLoss",)
# optimizer component -> the optimizer member of the spec (None: the workload's AdamW, PyTorch's implementation)
OPTIMIZERS = {
    "torch.optim.AdamW": "", "torch.optim.Adam": "optimizer:name=adam", "torch.optim.SGD": "optimizer:name=sgd",
    "torch.optim.Adafactor": "optimizer:name=adafactor",
    "torchao.optim.AdamW8bit": "optimizer:name=adamw8bit", "torchao.optim.AdamW4bit": "optimizer:name=adamw4bit",
    "torchao.prototype.low_bit_optim.AdamW8bit": "optimizer:name=adamw8bit",
    "torchao.prototype.low_bit_optim.AdamW4bit": "optimizer:name=adamw4bit",
    "bitsandbytes.optim.AdamW8bit": "optimizer:name=adamw8bit:impl=bitsandbytes",
    "bitsandbytes.optim.Adam8bit": "optimizer:name=adamw8bit:impl=bitsandbytes",
    "bitsandbytes.optim.PagedAdamW8bit": "optimizer:name=adamw8bit:impl=bitsandbytes:paged=true",
}
_HOST_SIDE = "read on the host or on disk: does not change the GPU memory of a step"

KEYS = (
    Key("model._component_", USED, "the architecture (the builder's model, as a membench preset or Hub id) and "
                                   "LoRA/QLoRA (lora_/qlora_ builders)"),
    Key("model.lora_attn_modules", USED, "lora targets: the attention projections (output_proj is o_proj)"),
    Key("model.apply_lora_to_mlp", USED, "lora targets: gate_proj/up_proj/down_proj"),
    Key("model.apply_lora_to_output", USED, "lora targets: the output head (lm_head)"),
    Key("model.lora_rank", USED, "lora:r"),
    Key("model.lora_alpha", USED, "lora:alpha"),
    Key("model.lora_dropout", USED, "lora:dropout"),
    Key("model.quantize_base", USED, "qlora: the base weights in NF4"),
    Key("model.use_dora", NOT_MODELLED, "DoRA's magnitude vectors and weight norms: predicted as LoRA"),
    Key("model.*", NOT_MODELLED, "a builder argument membench does not read: the builder's default assumed"),
    Key("dtype", USED, "bf16: bf16_weights (weights, adapters, gradients, optimizer state in bfloat16); fp32: none"),
    Key("batch_size", USED, "the batch per device is batch_size x gradient_accumulation_steps"),
    Key("gradient_accumulation_steps", USED, "grad_accumulation:micro_batches, the batch x this"),
    Key("tokenizer.max_seq_len", USED, "the workload's seq_len"),
    Key("dataset.packed", USED, "the workload's packed documents per row"),
    Key("dataset._component_", IGNORED, "which data set: its samples' lengths matter only through max_seq_len "
                                        "and packing"),
    Key("dataset.*", IGNORED, "how the data set is read or templated: " + _HOST_SIDE),
    Key("enable_activation_checkpointing", USED, "checkpoint:segments=all (every decoder layer)"),
    Key("enable_activation_offloading", USED, "offload_activations"),
    Key("activation_offloading_use_streams", USED, "offload_activations:use_streams"),
    Key("compile", USED, "compile:scope=layers:loss=true (each decoder layer and the loss)"),
    Key("optimizer._component_", USED, "the optimizer (optimizer:name/impl)"),
    Key("optimizer.fused", USED, "optimizer:impl=fused"),
    Key("optimizer.foreach", USED, "optimizer:impl=foreach (true) or for_loop (false)"),
    Key("optimizer.lr", IGNORED, "the learning rate: values, not memory"),
    Key("optimizer.weight_decay", IGNORED, "a hyperparameter: values, not memory"),
    Key("optimizer.betas", IGNORED, "a hyperparameter: values, not memory"),
    Key("optimizer.eps", IGNORED, "a hyperparameter: values, not memory"),
    Key("optimizer.*", NOT_MODELLED, "an optimizer argument membench does not read: its default assumed"),
    Key("optimizer_in_bwd", USED, "optimizer_in_backward"),
    Key("loss._component_", USED, "chunked_loss for a chunked cross-entropy; none for the whole logits'"),
    Key("loss.num_output_chunks", USED, "chunked_loss:chunks"),
    Key("loss.*", NOT_MODELLED, "a loss argument membench does not read: its default assumed"),
    Key("clip_grad_norm", NOT_MODELLED, "gradient clipping's norm: small temporaries, not counted"),
    Key("tokenizer.*", IGNORED, "the tokenizer's files and template: " + _HOST_SIDE),
    Key("checkpointer.*", IGNORED, "where weights are read and saved: " + _HOST_SIDE),
    Key("checkpointer", IGNORED, "where weights are read and saved: " + _HOST_SIDE),
    Key("resume_from_checkpoint", IGNORED, "whether a run resumes: " + _HOST_SIDE),
    Key("save_adapter_weights_only", IGNORED, "what is saved: " + _HOST_SIDE),
    Key("output_dir", IGNORED, "where outputs go: " + _HOST_SIDE),
    Key("seed", IGNORED, "the random seed: values, not memory"),
    Key("shuffle", IGNORED, "the order of samples: values, not memory"),
    Key("epochs", IGNORED, "how long training lasts: each step is the same"),
    Key("max_steps_per_epoch", IGNORED, "how long training lasts: each step is the same"),
    Key("lr_scheduler.*", IGNORED, "the learning-rate schedule: values, not memory (a scheduler holds no tensors)"),
    Key("lr_scheduler", IGNORED, "the learning-rate schedule: values, not memory"),
    Key("metric_logger.*", IGNORED, "logging: " + _HOST_SIDE),
    Key("metric_logger", IGNORED, "logging: " + _HOST_SIDE),
    Key("log_every_n_steps", IGNORED, "logging: " + _HOST_SIDE),
    Key("log_peak_memory_stats", IGNORED, "logging: " + _HOST_SIDE),
    Key("log_level", IGNORED, "logging: " + _HOST_SIDE),
    Key("device", IGNORED, "the device: membench predicts the one its command names (--gpu, --device)"),
    Key("profiler.*", IGNORED, "the profiler (disabled, or outside the steps membench predicts)"),
    Key("profiler", IGNORED, "the profiler (disabled, or outside the steps membench predicts)"),
    Key("fsdp_cpu_offload", NOT_MODELLED, "a distributed recipe's FSDP CPU offload: predicted on one device "
                                          "unless --ranks"),
    Key("fsdp_reshard_after_forward", NOT_MODELLED, "a distributed recipe's FSDP setting: predicted on one "
                                                    "device unless --ranks"),
    Key("custom_sharded_layers", NOT_MODELLED, "a distributed recipe's FSDP units: predicted on one device"),
    Key("tensor_parallel_*", NOT_MODELLED, "tensor parallelism: predicted on one device"),
    Key("quantizer.*", NOT_MODELLED, "quantisation-aware training's fake quantisation: not predicted"),
    Key("low_cpu_ram", IGNORED, "host memory while loading: not the GPU's"),
    Key("run_val_every_n_steps", IGNORED, "validation between steps: the training step is predicted"),
    Key("dataset_val.*", IGNORED, "validation data: the training step is predicted"),
    Key("batch_size_val", IGNORED, "validation batch: the training step is predicted"),
)


def builder_model(component: str) -> tuple[str, str]:
    """(membench preset or Hub id, kind: full/lora/qlora) of a torchtune model builder; a UsageError naming the
    known builders otherwise."""
    match = re.fullmatch(r"torchtune\.models\.\w+\.(lora_|qlora_)?(\w+)", component or "")
    if not match or match.group(2) not in BUILDERS:
        raise UsageError(f"torchtune key model._component_: unknown builder {component!r}; valid choices: "
                         + ", ".join(f"torchtune.models.<family>.[lora_|qlora_]{name}" for name in BUILDERS))
    return BUILDERS[match.group(2)], (match.group(1) or "full_").rstrip("_")


def read_torchtune(data: dict[str, Any], source: str, overrides: tuple[str, ...] = ()) -> DerivedJob:
    """The DerivedJob of a torchtune recipe configuration (already loaded, overrides applied)."""
    reading = Reading(KIND, resolve_interpolations(data), KEYS, nested=("*",))
    component = reading.get("model._component_", types=(str,))
    if component is None:
        raise UsageError("torchtune key model._component_: missing; a recipe configuration names its model builder "
                         "(e.g. torchtune.models.llama3_1.lora_llama3_1_8b)")
    model, kind = builder_model(component)
    reading.used("model._component_", f"the architecture: {model}" + (f", {kind}" if kind != "full" else ""))
    members = []
    dtype = reading.get("dtype", "fp32", types=(str,), choices=("bf16", "fp32"))
    if dtype == "bf16":
        members.append("bf16_weights")
    reading.used("dtype", "bf16_weights" if dtype == "bf16" else "float32 weights (no strategy)")
    if reading.get("model.quantize_base", False, types=(bool,)):
        kind = "qlora"
    if kind != "full":
        members.append(_lora_member(reading, kind))
    members += _training_members(reading)
    seq_len, packed = _sequence(reading)
    micro = reading.get("batch_size", 1, types=(int,))
    steps = reading.get("gradient_accumulation_steps", 1, types=(int,))
    if micro < 1 or steps < 1:
        raise UsageError(f"torchtune keys batch_size={micro}, gradient_accumulation_steps={steps}: each must be "
                         "a positive integer")
    if steps > 1:
        members.append(f"grad_accumulation:micro_batches={steps}")
        if reading.get("optimizer_in_bwd", False):
            raise UsageError("torchtune keys optimizer_in_bwd=True and gradient_accumulation_steps>1: torchtune "
                             "refuses the combination; valid: gradient_accumulation_steps=1")
    reading.used("batch_size", f"batch per device {micro * steps} ({micro} x {steps} accumulation steps)")
    reading.used("gradient_accumulation_steps", f"grad_accumulation:micro_batches={steps}" if steps > 1
                 else "one micro-batch")
    job = DerivedJob(kind=KIND, source=source, overrides=overrides, model=component,
                     workload=hf_workload(model_workload(model, "model._component_"), seq_len, packed=packed),
                     strategy=spec_of(members), batch_size=micro * steps, keys=reading.finish(),
                     assumptions=reading.assumptions)
    return job


def _lora_member(reading: Reading, kind: str) -> str:
    attention = reading.get("model.lora_attn_modules", ["q_proj", "v_proj"], types=(list,))
    unknown = [m for m in attention if m not in ATTENTION_MODULES]
    if unknown:
        raise UsageError(f"torchtune key model.lora_attn_modules: unknown module {unknown[0]!r}; valid choices: "
                         f"{', '.join(ATTENTION_MODULES)}")
    targets = [ATTENTION_MODULES[m] for m in attention]
    if reading.get("model.apply_lora_to_mlp", False, types=(bool,)):
        targets += MLP_MODULES
    if reading.get("model.apply_lora_to_output", False, types=(bool,)):
        targets.append("lm_head")
    rank = reading.get("model.lora_rank", 8, types=(int,))
    alpha = reading.get("model.lora_alpha", 16, types=(int, float))
    dropout = reading.get("model.lora_dropout", 0.0, types=(int, float))
    for key in ("model.lora_attn_modules", "model.apply_lora_to_mlp", "model.apply_lora_to_output",
                "model.lora_rank", "model.lora_alpha", "model.lora_dropout", "model.quantize_base"):
        reading.used(key)
    alpha_text = int(alpha) if float(alpha).is_integer() else alpha
    options = f"r={rank}:alpha={alpha_text}" + (f":dropout={dropout}" if dropout else "")
    return f"{kind}:{options}:targets={'/'.join(targets)}"


def _training_members(reading: Reading) -> list[str]:
    members = []
    if reading.get("enable_activation_checkpointing", False, types=(bool,)):
        members.append("checkpoint:segments=all")
    reading.used("enable_activation_checkpointing", "checkpoint:segments=all (every decoder layer)"
                 if "checkpoint:segments=all" in members else "off")
    if reading.get("enable_activation_offloading", False, types=(bool,)):
        streams = reading.get("activation_offloading_use_streams", True, types=(bool,))
        members.append("offload_activations" + ("" if streams else ":use_streams=false"))
    offloading = any(m.startswith("offload_activations") for m in members)
    reading.used("enable_activation_offloading", "offload_activations" if offloading else "off")
    reading.used("activation_offloading_use_streams")
    if reading.get("compile", False, types=(bool,)):
        members.append("compile:scope=layers:loss=true")
    reading.used("compile", "compile:scope=layers:loss=true (each decoder layer and the loss)"
                 if reading.get("compile") else "off")
    members.append(_optimizer_member(reading))
    if reading.get("optimizer_in_bwd", False, types=(bool,)):
        members.append("optimizer_in_backward")
    reading.used("optimizer_in_bwd", "optimizer_in_backward" if "optimizer_in_backward" in members else "off")
    loss = reading.get("loss._component_", "torch.nn.CrossEntropyLoss", types=(str,),
                       choices=CHUNKED_LOSSES + WHOLE_LOSSES)
    if loss in CHUNKED_LOSSES:
        chunks = reading.get("loss.num_output_chunks", 8, types=(int,))
        members.append("chunked_loss" + (f":chunks={chunks}" if chunks != 8 else ""))
        reading.used("loss._component_", f"chunked_loss ({loss.rsplit('.', 1)[1]}): the loss over chunks of the "
                                         "output")
        reading.not_modelled("loss._component_", f"chunked_loss: {loss.rsplit('.', 1)[1]}'s chunks of the output "
                                                 "predicted as membench's chunked_loss, which recomputes each "
                                                 "chunk's logits in backward (CEWithChunkedOutputLoss keeps the "
                                                 "whole bfloat16 logits and upcasts one chunk at a time)")
    else:
        reading.used("loss._component_", "the cross-entropy over the whole logits (no strategy)")
    reading.used("loss.num_output_chunks")
    return members


def _optimizer_member(reading: Reading) -> str:
    component = reading.get("optimizer._component_", "torch.optim.AdamW", types=(str,), choices=OPTIMIZERS)
    member = OPTIMIZERS[component]
    fused = reading.get("optimizer.fused", None, types=(bool, type(None)))
    foreach = reading.get("optimizer.foreach", None, types=(bool, type(None)))
    if component.startswith("torch.optim."):
        impl = "fused" if fused else "foreach" if foreach else "for_loop" if foreach is False else None
        if impl:
            member = f"{member or 'optimizer'}:impl={impl}"
    elif fused is not None or foreach is not None:
        raise UsageError(f"torchtune keys optimizer.fused/foreach: {component} takes neither; valid with "
                         "torch.optim optimizers")
    reading.used("optimizer._component_", member or "the workload's AdamW in PyTorch's implementation (foreach on "
                                                    "CUDA)")
    reading.used("optimizer.fused")
    reading.used("optimizer.foreach")
    return member


def _sequence(reading: Reading) -> tuple[int, int]:
    """(seq_len, packed documents) of the configuration."""
    max_seq_len = reading.get("tokenizer.max_seq_len", None, types=(int, type(None)))
    packed = reading.get("dataset.packed", False, types=(bool,))
    if max_seq_len is None:
        if packed:
            raise UsageError("torchtune keys dataset.packed=True and tokenizer.max_seq_len=null: torchtune refuses "
                             "packing without a length; give tokenizer.max_seq_len=N")
        reading.assume(f"tokenizer.max_seq_len is null: each batch is padded to its longest sample, which the "
                       f"configuration does not state; {ASSUMED_SEQ_LEN} tokens assumed (override: "
                       f"tokenizer.max_seq_len=N)")
        seq_len = ASSUMED_SEQ_LEN
    else:
        seq_len = max_seq_len
        if not packed:
            reading.assume(f"unpacked data: each batch padded to its longest sample, at most tokenizer.max_seq_len; "
                           f"the longest, {seq_len} tokens, predicted")
    documents = packed_documents(seq_len) if packed else 0
    if packed:
        reading.assume(f"packed rows of {seq_len} tokens hold {documents} documents (the data's; about "
                       f"{seq_len // documents} tokens each assumed; the mask's size does not depend on it)")
    reading.used("tokenizer.max_seq_len", f"seq_len={seq_len}")
    reading.used("dataset.packed", f"packed={documents}" if packed else "unpacked (packed=0)")
    return seq_len, documents
