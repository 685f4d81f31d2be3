"""Hugging Face Trainer and TRL SFTTrainer configurations (TrainingArguments / SFTConfig, with peft's LoraConfig and
transformers' BitsAndBytesConfig beside them) as a membench case, as the installed Trainer would run them.

The file layout (YAML or JSON) is the one `trl sft --config FILE` reads: TrainingArguments or SFTConfig fields and
TRL's ModelConfig fields, flat (`model_name_or_path`, `dtype`, `attn_implementation`, `use_peft`, `lora_r`,
`lora_alpha`, `lora_dropout`, `lora_target_modules`, `load_in_4bit`, `bnb_4bit_quant_type`, `use_bnb_nested_quant`),
plus two optional sections holding the objects a script builds beside them: `lora:` (peft.LoraConfig's arguments:
`r`, `lora_alpha`, `lora_dropout`, `target_modules`, ...) and `quantization:` (transformers.BitsAndBytesConfig's:
`load_in_4bit`, `bnb_4bit_quant_type`, `bnb_4bit_use_double_quant`, `bnb_4bit_compute_dtype`, ...); `task:`
(causal_lm, masked_lm or seq_cls: the AutoModelFor... class a Trainer script loads; SFTTrainer's is causal_lm); and
`versions:` ({transformers: "4.18", torch: "1.13"}) where the job ran older libraries than the installed ones, for
the two defaults that changed (below). A file with any SFTConfig or ModelConfig key is read as TRL's SFTTrainer.

What the Trainer does with each setting, read from transformers 5 and TRL 1 (the installed ones):
- `optim`: `adamw_torch` is torch.optim.AdamW with PyTorch's choice of implementation (foreach on CUDA; the
  workload's own AdamW), `adamw_torch_fused` fused=True, `adamw_torch_8bit`/`4bit` torchao's low-bit AdamW,
  `adamw_8bit`/`adamw_bnb_8bit` bitsandbytes' AdamW8bit, `paged_adamw_8bit` its paged form, `adafactor`
  transformers' Adafactor, `sgd` (trainer_optimizer.py). The default is `adamw_torch_fused` on torch >= 2.8
  (training_args.py); with `versions: {transformers: < 4.32}` it is `adamw_hf`, transformers' own AdamW (a Python
  loop over the parameters) until PR #25109;
- `bf16`/`fp16`: accelerate's autocast around the forward (`amp`), on whatever dtype the model was loaded in
  (`dtype`: bfloat16 gives `bf16_weights`); SFTConfig's bf16 defaults to True unless fp16;
- the model's dtype: `dtype` (or `torch_dtype`, `model_init_kwargs.dtype`); absent, float32 (TRL loads a Hub id in
  float32; a plain Trainer script's from_pretrained in transformers 5 loads the checkpoint's dtype: give `dtype`);
- `gradient_checkpointing`/`activation_checkpointing`: every decoder layer (`checkpoint:segments=all`);
  `..._kwargs.use_reentrant` (non-reentrant unless given; reentrant saves the same layer inputs),
  `offload` (the checkpoints' inputs in pinned host memory: `offload`); SFTConfig's default is True;
- `per_device_train_batch_size` x `gradient_accumulation_steps` is one step's batch per device
  (`grad_accumulation` splits it into micro-batches);
- the loss is the model's own from `labels=` (`loss=model`), as Trainer.compute_loss computes it;
- SFTConfig's `max_length` (default 1024) is the sequence length; `packing` packs rows of max_length tokens
  (membench's `packed` documents); `padding_free` without packing flattens the batch (not modelled);
- `torch_compile`: the model compiled whole (`compile`); `use_liger_kernel`: Liger's fused linear cross-entropy
  (`chunked_loss`); with `versions: {torch: < 2.0}`, the Trainer's model.zero_grad() kept the gradients
  (`keep_grads`).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from bench.core.errors import UsageError
from bench.jobs.job import (IGNORED, NOT_MODELLED, USED, DerivedJob, Key, Reading, hf_workload, packed_documents,
                            spec_of)
from bench.jobs.models import model_workload

KIND_TRAINER, KIND_TRL = "trainer", "trl"
SECTIONS = ("lora", "quantization", "versions", "model_init_kwargs", "gradient_checkpointing_kwargs",
            "activation_checkpointing_kwargs")
TASKS = ("causal_lm", "masked_lm", "seq_cls")
DEFAULT_MAX_LENGTH = 1024  # SFTConfig's max_length; a plain Trainer's sequences are the script's, assumed the same
# the Trainer's `optim` -> the spec's optimizer member ("": the workload's AdamW, PyTorch's choice of implementation)
OPTIMS = {
    "adamw_torch": "", "adamw_torch_fused": "optimizer:impl=fused",
    "adamw_torch_8bit": "optimizer:name=adamw8bit", "adamw_torch_4bit": "optimizer:name=adamw4bit",
    "adamw_bnb_8bit": "optimizer:name=adamw8bit:impl=bitsandbytes",
    "adamw_8bit": "optimizer:name=adamw8bit:impl=bitsandbytes",
    "paged_adamw_8bit": "optimizer:name=adamw8bit:impl=bitsandbytes:paged=true",
    "adafactor": "optimizer:name=adafactor", "sgd": "optimizer:name=sgd",
    "adamw_hf": "optimizer:name=adamw:impl=for_loop",  # transformers < 5: its own AdamW, a loop over parameters
}
OPTIM_NOTES = {
    "adafactor": "transformers' Adafactor (scale_parameter=False, relative_step=False): torch.optim.Adafactor's "
                 "state (factored second moments) predicted",
    "adamw_8bit": "bitsandbytes' 8-bit state; the Trainer keeps nn.Embedding weights' state in 32 bits "
                  "(register_module_override optim_bits=32): predicted 8-bit",
    "adamw_bnb_8bit": "bitsandbytes' 8-bit state; the Trainer keeps nn.Embedding weights' state in 32 bits: "
                      "predicted 8-bit",
    "paged_adamw_8bit": "bitsandbytes' paged 8-bit state (unified memory, not counted by the allocator); the "
                        "Trainer keeps nn.Embedding weights' state in 32 bits: predicted 8-bit",
    "adamw_hf": "transformers.AdamW (removed in transformers 5): a Python loop over the parameters, as "
                "torch.optim.AdamW(foreach=False)",
}
DTYPES = {"float32": "", "fp32": "", "bfloat16": "bf16_weights", "bf16": "bf16_weights", "auto": None,
          "float16": "fp16", "fp16": "fp16"}
TRANSFORMERS_ADAMW_HF_UNTIL = (4, 32)  # PR #25109 made adamw_torch the default (transformers 4.32)
TORCH_SET_TO_NONE_FROM = (2, 0)  # Module.zero_grad(set_to_none=True) became the default in torch 2.0
_NOT_MEMORY = "does not change a step's memory"
_HOST = "host-side (logging, saving, data loading, evaluation, the Hub): " + _NOT_MEMORY

KEYS = (
    Key("model_name_or_path", USED, "the model: hf:<Hub id or path>"),
    Key("model_revision", USED, "the model's revision: hf:<id>@revision"),
    Key("task", USED, "the workload's task (the AutoModelFor... class)"),
    Key("dtype", USED, "the weights' dtype as loaded: bfloat16 -> bf16_weights"),
    Key("torch_dtype", USED, "the weights' dtype as loaded: bfloat16 -> bf16_weights"),
    Key("model_init_kwargs.dtype", USED, "the weights' dtype as loaded: bfloat16 -> bf16_weights"),
    Key("model_init_kwargs.torch_dtype", USED, "the weights' dtype as loaded: bfloat16 -> bf16_weights"),
    Key("attn_implementation", USED, "the workload's attn (sdpa or eager; flash_attention_2 predicted as sdpa)"),
    Key("model_init_kwargs.attn_implementation", USED, "the workload's attn"),
    Key("model_init_kwargs.*", NOT_MODELLED, "a from_pretrained argument membench does not read: its default"),
    Key("per_device_train_batch_size", USED, "the batch per device, times gradient_accumulation_steps"),
    Key("gradient_accumulation_steps", USED, "grad_accumulation:micro_batches"),
    Key("bf16", USED, "amp:dtype=bfloat16 (autocast)"),
    Key("fp16", USED, "amp:dtype=float16 (autocast and GradScaler)"),
    Key("optim", USED, "the optimizer (optimizer:name/impl)"),
    Key("gradient_checkpointing", USED, "checkpoint:segments=all"),
    Key("activation_checkpointing", USED, "checkpoint:segments=all"),
    Key("gradient_checkpointing_kwargs.use_reentrant", USED, "reentrant or not: the same layer inputs saved"),
    Key("activation_checkpointing_kwargs.use_reentrant", USED, "reentrant or not: the same layer inputs saved"),
    Key("gradient_checkpointing_kwargs.offload", USED, "offload (the checkpoints' inputs in pinned host memory)"),
    Key("activation_checkpointing_kwargs.offload", USED, "offload (the checkpoints' inputs in pinned host memory)"),
    Key("gradient_checkpointing_kwargs.every_n_layers", NOT_MODELLED, "every layer checkpointed instead"),
    Key("activation_checkpointing_kwargs.every_n_layers", NOT_MODELLED, "every layer checkpointed instead"),
    Key("gradient_checkpointing_kwargs.*", NOT_MODELLED, "a checkpoint() argument membench does not read"),
    Key("activation_checkpointing_kwargs.*", NOT_MODELLED, "a checkpoint() argument membench does not read"),
    Key("torch_compile", USED, "compile (the model compiled whole)"),
    Key("torch_compile_backend", USED, "compile:backend"),
    Key("torch_compile_mode", NOT_MODELLED, "inductor's default mode predicted"),
    Key("use_liger_kernel", USED, "chunked_loss (Liger's fused linear cross-entropy)"),
    Key("liger_kernel_config", NOT_MODELLED, "Liger's other kernels (RMSNorm, SwiGLU, RoPE): transformers' own "
                                             "predicted"),
    Key("max_length", USED, "the workload's seq_len"),
    Key("max_seq_length", USED, "the workload's seq_len (TRL's former name of max_length)"),
    Key("packing", USED, "the workload's packed documents per row"),
    Key("packing_strategy", USED, "bfd packs padding-free (position ids restart per document); wrapped does not"),
    Key("padding_free", NOT_MODELLED, "the batch flattened into one row without padding: predicted as padded rows "
                                      "of max_length"),
    Key("use_peft", USED, "lora from TRL's lora_* keys"),
    Key("lora_r", USED, "lora:r"), Key("lora_alpha", USED, "lora:alpha"), Key("lora_dropout", USED, "lora:dropout"),
    Key("lora_target_modules", USED, "lora:targets"),
    Key("lora_task_type", IGNORED, "peft's task type: the same adapters"),
    Key("lora_modules_to_save", NOT_MODELLED, "fully trained copies of these modules: not predicted"),
    Key("lora_target_parameters", NOT_MODELLED, "adapters on parameters: not predicted"),
    Key("use_rslora", IGNORED, "rank-stabilised scaling: the same tensors"),
    Key("use_dora", NOT_MODELLED, "DoRA's magnitude vectors and weight norms: predicted as LoRA"),
    Key("load_in_4bit", USED, "qlora (NF4 base weights)"),
    Key("load_in_8bit", USED, "refused: membench has no 8-bit weights"),
    Key("bnb_4bit_quant_type", USED, "nf4 or fp4: the same 4-bit storage"),
    Key("use_bnb_nested_quant", USED, "double quantisation of the block scales (membench's qlora always does)"),
    Key("bnb_4bit_quant_storage", IGNORED, "the dtype the 4-bit codes are packed in: the same bytes"),
    Key("lora.r", USED, "lora:r"), Key("lora.lora_alpha", USED, "lora:alpha"),
    Key("lora.lora_dropout", USED, "lora:dropout"), Key("lora.target_modules", USED, "lora:targets"),
    Key("lora.task_type", IGNORED, "peft's task type: the same adapters"),
    Key("lora.bias", NOT_MODELLED, "trained biases: predicted frozen"),
    Key("lora.modules_to_save", NOT_MODELLED, "fully trained copies of these modules: not predicted"),
    Key("lora.use_dora", NOT_MODELLED, "DoRA's magnitude vectors and weight norms: predicted as LoRA"),
    Key("lora.use_rslora", IGNORED, "rank-stabilised scaling: the same tensors"),
    Key("lora.init_lora_weights", IGNORED, "the adapters' initial values: the same tensors"),
    Key("lora.inference_mode", IGNORED, "false when training"),
    Key("lora.peft_type", IGNORED, "LORA"), Key("lora.base_model_name_or_path", IGNORED, "the model is read above"),
    Key("lora.revision", IGNORED, "the model is read above"),
    Key("lora.*", NOT_MODELLED, "a LoraConfig argument membench does not read: peft's default"),
    Key("quantization.load_in_4bit", USED, "qlora (NF4 base weights)"),
    Key("quantization.load_in_8bit", USED, "refused: membench has no 8-bit weights"),
    Key("quantization.bnb_4bit_quant_type", USED, "nf4 or fp4: the same 4-bit storage"),
    Key("quantization.bnb_4bit_use_double_quant", USED, "double quantisation (membench's qlora always does)"),
    Key("quantization.bnb_4bit_compute_dtype", USED, "the product's dtype: the input's (bf16_weights: bfloat16)"),
    Key("quantization.bnb_4bit_quant_storage", IGNORED, "the dtype the codes are packed in: the same bytes"),
    Key("quantization.quant_method", IGNORED, "bitsandbytes"),
    Key("quantization.llm_int8_*", IGNORED, "8-bit loading's settings: unused with 4-bit"),
    Key("quantization._load_in_*", IGNORED, "BitsAndBytesConfig's private copy of load_in_4bit/8bit"),
    Key("quantization.*", NOT_MODELLED, "a BitsAndBytesConfig argument membench does not read: its default"),
    Key("versions.transformers", USED, "the Trainer's defaults of that version (optim)"),
    Key("versions.torch", USED, "torch's defaults of that version (zero_grad's set_to_none)"),
    Key("max_grad_norm", NOT_MODELLED, "gradient clipping's norm: small temporaries, not counted"),
    Key("label_smoothing_factor", NOT_MODELLED, "the label smoother's log-softmax of the logits: the model's "
                                                "loss predicted"),
    Key("neftune_noise_alpha", NOT_MODELLED, "noise added to the embeddings' output: one tensor, not counted"),
    Key("torch_empty_cache_steps", NOT_MODELLED, "empty_cache every N steps: the allocated peak is the same, the "
                                                 "reserved one predicted without"),
    Key("fsdp", NOT_MODELLED, "FSDP through accelerate: predicted on one device (use --ranks with the fsdp "
                              "strategy)"),
    Key("fsdp_config", NOT_MODELLED, "FSDP through accelerate: predicted on one device"),
    Key("deepspeed", NOT_MODELLED, "DeepSpeed: predicted on one device without it"),
    Key("tf32", IGNORED, "TensorFloat-32 matmuls: precision, " + _NOT_MEMORY),
    Key("use_cpu", IGNORED, "the device: membench predicts the one its command names"),
    Key("learning_rate", IGNORED, "a hyperparameter: values, " + _NOT_MEMORY),
    Key("weight_decay", IGNORED, "a hyperparameter: values, " + _NOT_MEMORY),
    Key("adam_*", IGNORED, "a hyperparameter: values, " + _NOT_MEMORY),
    Key("lr_scheduler_*", IGNORED, "the learning-rate schedule holds no tensors"),
    Key("warmup_*", IGNORED, "the learning-rate schedule holds no tensors"),
    Key("optim_args", NOT_MODELLED, "extra optimizer arguments: their defaults assumed"),
    Key("num_train_epochs", IGNORED, "how long training lasts: each step is the same"),
    Key("max_steps", IGNORED, "how long training lasts: each step is the same"),
    Key("seed", IGNORED, "values, " + _NOT_MEMORY), Key("data_seed", IGNORED, "values, " + _NOT_MEMORY),
    Key("full_determinism", IGNORED, "deterministic kernels: the same tensors"),
    Key("output_dir", IGNORED, _HOST), Key("overwrite_output_dir", IGNORED, _HOST), Key("run_name", IGNORED, _HOST),
    Key("logging_*", IGNORED, _HOST), Key("log_*", IGNORED, _HOST), Key("report_to", IGNORED, _HOST),
    Key("save_*", IGNORED, _HOST), Key("eval_*", IGNORED, _HOST), Key("per_device_eval_batch_size", IGNORED, _HOST),
    Key("do_*", IGNORED, _HOST), Key("push_to_hub", IGNORED, _HOST), Key("hub_*", IGNORED, _HOST),
    Key("dataloader_*", IGNORED, _HOST), Key("dataset_*", IGNORED, _HOST), Key("remove_unused_columns", IGNORED, _HOST),
    Key("disable_tqdm", IGNORED, _HOST), Key("load_best_model_at_end", IGNORED, _HOST),
    Key("metric_for_best_model", IGNORED, _HOST), Key("greater_is_better", IGNORED, _HOST),
    Key("resume_from_checkpoint", IGNORED, _HOST), Key("skip_memory_metrics", IGNORED, _HOST),
    Key("include_*", IGNORED, _HOST), Key("label_names", IGNORED, _HOST), Key("project", IGNORED, _HOST),
    Key("trackio_*", IGNORED, _HOST), Key("prediction_loss_only", IGNORED, _HOST),
    Key("ignore_data_skip", IGNORED, _HOST), Key("length_column_name", IGNORED, _HOST),
    Key("train_sampling_strategy", IGNORED, _HOST), Key("batch_eval_metrics", IGNORED, _HOST),
    Key("bf16_full_eval", IGNORED, "evaluation only"), Key("fp16_full_eval", IGNORED, "evaluation only"),
    Key("local_rank", IGNORED, "set by the launcher"), Key("ddp_*", NOT_MODELLED, "DDP's settings: one device "
                                                                                  "predicted"),
    Key("average_tokens_across_devices", IGNORED, "how the loss is normalised: one scalar"),
    Key("use_cache", IGNORED, "the key/value cache is off in training (membench's workload never keeps one)"),
    Key("auto_find_batch_size", NOT_MODELLED, "the Trainer's batch search: the given batch predicted"),
    Key("accelerator_config", IGNORED, "accelerate's dispatch settings: " + _NOT_MEMORY),
    Key("parallelism_config", NOT_MODELLED, "accelerate's parallelism: one device predicted"),
    Key("debug", IGNORED, _HOST), Key("enable_jit_checkpoint", IGNORED, _HOST),
    Key("restore_callback_states_from_checkpoint", IGNORED, _HOST),
    Key("dataset_text_field", IGNORED, _HOST), Key("dataset_kwargs", IGNORED, _HOST),
    Key("dataset_num_proc", IGNORED, _HOST), Key("chat_template_path", IGNORED, _HOST),
    Key("eos_token", IGNORED, _HOST), Key("pad_token", IGNORED, _HOST), Key("shuffle_dataset", IGNORED, _HOST),
    Key("truncation_mode", IGNORED, "which end is truncated: the same length"),
    Key("pad_to_multiple_of", NOT_MODELLED, "padding to a multiple: rows of max_length predicted"),
    Key("completion_only_loss", IGNORED, "which labels count: the same loss tensors"),
    Key("assistant_only_loss", IGNORED, "which labels count: the same loss tensors"),
    Key("loss_type", NOT_MODELLED, "nll predicted (dft reweights per token: small temporaries)"),
    Key("router_aux_loss_coef", IGNORED, "a coefficient: values"),
    Key("activation_offloading", USED, "offload_activations (TRL's activation offloading)"),
    Key("trust_remote_code", USED, "passed to the workload's configuration"),
    Key("ignore_bias_buffers", IGNORED, _HOST),
)


def _valid_fields(kind: str) -> dict[str, Any]:
    """The installed dataclasses' fields and their defaults: TrainingArguments (and SFTConfig, ModelConfig,
    ScriptArguments for TRL when installed)."""
    from workloads.hf import import_transformers

    transformers = import_transformers()
    classes = [transformers.TrainingArguments]
    if kind == KIND_TRL:
        try:
            import trl
            classes = [trl.SFTConfig, trl.ModelConfig, trl.ScriptArguments]
        except ImportError:
            pass
    fields = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            fields.setdefault(f.name, default.value if isinstance(default, enum.Enum) else default)
    return fields


# keys only SFTConfig or TRL's ModelConfig/ScriptArguments have (max_length and model_name_or_path are this layout's
# for a plain Trainer too)
TRL_ONLY = ("max_seq_length", "packing", "packing_strategy", "padding_free", "dataset_text_field",
            "model_init_kwargs", "completion_only_loss", "assistant_only_loss", "activation_offloading", "use_peft",
            "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "load_in_4bit", "load_in_8bit",
            "dataset_name", "loss_type")


def kind_of(values: dict[str, Any]) -> str:
    """trl where the configuration has a key only SFTConfig or TRL's ModelConfig/ScriptArguments has."""
    return KIND_TRL if any(key in values for key in TRL_ONLY) else KIND_TRAINER


def _version(text: Any, key: str) -> tuple[int, int]:
    parts = str(text).split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        raise UsageError(f"trainer key {key}: {text!r} is not a version (e.g. 4.18)") from None


def read_trainer(values: dict[str, Any], source: str, overrides: tuple[str, ...] = (),
                 kind: str | None = None, model: str | None = None) -> DerivedJob:
    """The DerivedJob of a Trainer/SFTTrainer configuration (a mapping of the layout above); `model`: a workload
    model to use where the configuration names none (a Hub id, a preset, a config.json path)."""
    kind = kind or kind_of(values)
    defaults = _valid_fields(kind)
    reading = Reading(kind, values, KEYS, nested=SECTIONS)
    default = lambda key, fallback=None: defaults.get(key, fallback)  # noqa: E731
    members: list[str] = []

    transformers_version = _version(reading.get("versions.transformers", "5.0"), "versions.transformers")
    torch_version = _version(reading.get("versions.torch", "2.13"), "versions.torch")
    weights = _weights_member(reading, kind)
    members.append(weights)
    members += _precision(reading, kind, default)
    adapters = _adapters(reading, kind)
    if adapters and weights == "bf16_weights":
        reading.assume("peft's get_peft_model keeps the adapters in float32 on a bfloat16 model "
                       "(autocast_adapter_dtype=True): predicted in bfloat16 with the weights (not modelled)")
    members += adapters
    members += _checkpointing(reading, default)
    members.append(_optimizer(reading, transformers_version, default))
    if torch_version < TORCH_SET_TO_NONE_FROM:
        members.append("keep_grads")
        reading.used("versions.torch", "torch < 2.0: the Trainer's model.zero_grad() zeroes the gradients in place "
                                       "(set_to_none=False): keep_grads")
    else:
        reading.used("versions.torch", "torch >= 2.0: zero_grad frees the gradients")
    if reading.get("torch_compile", False, types=(bool,)):
        backend = reading.get("torch_compile_backend", None, types=(str, type(None)), choices=(None, "inductor",
                                                                                                "aot_eager"))
        members.append("compile" + (":backend=aot_eager_decomp_partition" if backend == "aot_eager" else ""))
    reading.used("torch_compile", "compile" if reading.get("torch_compile") else "off")
    if reading.get("use_liger_kernel", False, types=(bool,)):
        members.append("chunked_loss")
        reading.not_modelled("use_liger_kernel", "chunked_loss: Liger's fused linear cross-entropy predicted as "
                                                 "membench's chunked loss (its other kernels, transformers' own)")
    if reading.get("activation_offloading", False, types=(bool,)):
        members.append("offload_activations")
    reading.used("activation_offloading", "offload_activations" if reading.get("activation_offloading") else "off")

    micro = reading.get("per_device_train_batch_size", default("per_device_train_batch_size", 8), types=(int,))
    steps = reading.get("gradient_accumulation_steps", 1, types=(int,))
    if micro < 1 or steps < 1:
        raise UsageError(f"{kind} keys per_device_train_batch_size={micro}, gradient_accumulation_steps={steps}: "
                         "each must be a positive integer")
    if steps > 1:
        members.append(f"grad_accumulation:micro_batches={steps}")
    reading.used("per_device_train_batch_size", f"batch per device {micro * steps} ({micro} x {steps})")
    reading.used("gradient_accumulation_steps", f"grad_accumulation:micro_batches={steps}" if steps > 1 else "one")
    if "per_device_train_batch_size" not in values:
        reading.assume(f"per_device_train_batch_size not given: the default, {micro}")

    workload, model_name = _workload(reading, kind, model)
    return DerivedJob(kind=kind, source=source, overrides=overrides, workload=workload, model=model_name,
                      strategy=spec_of(members), batch_size=micro * steps, keys=reading.finish(defaults),
                      assumptions=reading.assumptions)


def _weights_member(reading: Reading, kind: str) -> str:
    """bf16_weights where the model is loaded in bfloat16."""
    key = next((k for k in ("model_init_kwargs.dtype", "model_init_kwargs.torch_dtype", "dtype", "torch_dtype")
                if k in reading), None)
    dtype = reading.get(key, None, types=(str,), choices=DTYPES) if key else None
    if dtype is None or DTYPES[dtype] is None:
        reading.assume("the model's dtype: float32 (TRL loads a Hub id in float32 unless model_init_kwargs.dtype; a "
                       "plain Trainer script's from_pretrained in transformers 5 loads the checkpoint's dtype, "
                       "often bfloat16: then give dtype: bfloat16)" + (f" ({key}: auto read as float32)" if key
                                                                       else ""))
        if key:
            reading.not_modelled(key, "auto: the checkpoint's dtype is not read; float32 assumed")
        return ""
    if DTYPES[dtype] == "fp16":
        raise UsageError(f"{reading.kind} key {key}: float16 weights are not predicted by membench; valid choices: "
                         "float32, bfloat16 (fp16: true on float32 weights is autocast)")
    reading.used(key, DTYPES[dtype] or "float32 weights (no strategy)")
    return DTYPES[dtype]


def _precision(reading: Reading, kind: str, default) -> list[str]:
    fp16 = reading.get("fp16", False, types=(bool,))
    bf16 = reading.get("bf16", None, types=(bool, type(None)))
    if bf16 is None:
        bf16 = not fp16 if kind == KIND_TRL else bool(default("bf16", False))
        if kind == KIND_TRL and bf16:
            reading.assume("bf16 not given: SFTConfig's default, True (fp16 not set)")
    if bf16 and fp16:
        raise UsageError(f"{reading.kind} keys bf16 and fp16: both true; the Trainer refuses it; valid: one of them")
    reading.used("bf16", "amp:dtype=bfloat16 (accelerate's autocast)" if bf16 else "off")
    reading.used("fp16", "amp:dtype=float16 (autocast, GradScaler)" if fp16 else "off")
    return ["amp:dtype=bfloat16"] if bf16 else ["amp:dtype=float16"] if fp16 else []


def _targets(value: Any, key: str) -> str:
    if value is None:
        return "auto"
    if isinstance(value, str):
        return "all-linear" if value == "all-linear" else value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value) and value:
        return "/".join(value)
    raise UsageError(f"trainer key {key}: {value!r}; expected a module name, a list of them or all-linear")


def _adapters(reading: Reading, kind: str) -> list[str]:
    """lora/qlora from the `lora:` section, or TRL's use_peft and lora_* keys; 4-bit loading from `quantization:`
    or TRL's load_in_4bit."""
    section = any(key.startswith("lora.") for key in reading.values)
    use_peft = reading.get("use_peft", False, types=(bool,))
    reading.used("use_peft", "lora" if use_peft else "off")
    four_bit = bool(reading.get("quantization.load_in_4bit", False, types=(bool,))
                    or reading.get("load_in_4bit", False, types=(bool,)))
    for key in ("quantization.load_in_8bit", "load_in_8bit"):
        if reading.get(key, False, types=(bool,)):
            raise UsageError(f"{reading.kind} key {key}: 8-bit weights (LLM.int8) are not predicted by membench; "
                             "valid: load_in_4bit (QLoRA) or neither")
        reading.used(key, "off")
    if section:
        rank = reading.get("lora.r", 8, types=(int,))
        alpha = reading.get("lora.lora_alpha", 8, types=(int, float))
        dropout = reading.get("lora.lora_dropout", 0.0, types=(int, float))
        targets = _targets(reading.get("lora.target_modules"), "lora.target_modules")
        names = ("lora.r", "lora.lora_alpha", "lora.lora_dropout", "lora.target_modules")
    elif use_peft:
        rank = reading.get("lora_r", 16, types=(int,))
        alpha = reading.get("lora_alpha", 32, types=(int, float))
        dropout = reading.get("lora_dropout", 0.05, types=(int, float))
        targets = _targets(reading.get("lora_target_modules"), "lora_target_modules")
        names = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
    else:
        if four_bit:
            raise UsageError(f"{reading.kind} key load_in_4bit: a 4-bit model trains only adapters; give a lora: "
                             "section (peft's LoraConfig) or use_peft: true")
        return []
    for key in names:
        reading.used(key)
    alpha_text = int(alpha) if float(alpha).is_integer() else alpha
    kind_name = "qlora" if four_bit else "lora"
    for key in ("quantization.load_in_4bit", "load_in_4bit"):
        reading.used(key, "qlora (NF4 base weights)" if four_bit else "off")
    quant_type = reading.get("quantization.bnb_4bit_quant_type", None, types=(str, type(None)), choices=(None, "nf4",
                                                                                                        "fp4"))
    quant_type = reading.get("bnb_4bit_quant_type", quant_type, types=(str,), choices=("nf4", "fp4"))
    double = reading.get("quantization.bnb_4bit_use_double_quant", None, types=(bool, type(None)))
    double = reading.get("use_bnb_nested_quant", double, types=(bool,))
    if four_bit and not double:
        for key in ("quantization.bnb_4bit_use_double_quant", "use_bnb_nested_quant"):
            reading.not_modelled(key, "single quantisation: membench's qlora double-quantises the block scales "
                                      "(0.5 bytes per 64 values less than float32 scales)")
    if four_bit and quant_type == "fp4":
        reading.used("bnb_4bit_quant_type", "fp4: the same 4-bit storage as nf4")
    if "quantization.bnb_4bit_compute_dtype" in reading:
        reading.used("quantization.bnb_4bit_compute_dtype", "the product runs in the input's dtype")
    options = f"r={rank}:alpha={alpha_text}" + (f":dropout={dropout}" if dropout else "") + f":targets={targets}"
    return [f"{kind_name}:{options}"]


def _checkpointing(reading: Reading, default) -> list[str]:
    on = None
    for key in ("activation_checkpointing", "gradient_checkpointing"):
        value = reading.get(key, None, types=(bool, type(None)))
        if value is not None and on is None:
            on = value
    if on is None:
        on = bool(default("gradient_checkpointing", False))
        if on:
            reading.assume("gradient_checkpointing not given: SFTConfig's default, True")
    for key in ("activation_checkpointing", "gradient_checkpointing"):
        reading.used(key, "checkpoint:segments=all (every decoder layer)" if on else "off")
    members = ["checkpoint:segments=all"] if on else []
    for prefix in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        reentrant = reading.get(f"{prefix}.use_reentrant", None, types=(bool, type(None)))
        if reentrant:
            reading.not_modelled(f"{prefix}.use_reentrant", "reentrant checkpointing predicted as non-reentrant: "
                                                            "the same layer inputs saved")
        else:
            reading.used(f"{prefix}.use_reentrant", "non-reentrant (transformers' default)")
        if reading.get(f"{prefix}.offload", False, types=(bool,)) and on:
            members.append("offload")
        reading.used(f"{prefix}.offload")
    return members


def _optimizer(reading: Reading, transformers_version: tuple[int, int], default) -> str:
    if "optim" in reading:
        optim = reading.get("optim", types=(str,), choices=OPTIMS)
    elif transformers_version < TRANSFORMERS_ADAMW_HF_UNTIL:
        optim = "adamw_hf"
        reading.assume("optim not given: transformers < 4.32's default, adamw_hf (transformers.AdamW)")
    else:
        optim = default("optim", "adamw_torch")
        reading.assume(f"optim not given: the installed Trainer's default, {optim}")
    if optim == "adamw_hf" and transformers_version >= (5, 0):
        raise UsageError("trainer key optim: adamw_hf was removed in transformers 5; give versions: {transformers: "
                         "'4.x'} for a job of that era, or one of: " + ", ".join(o for o in OPTIMS if o != "adamw_hf"))
    member = OPTIMS[optim]
    detail = member or "the workload's AdamW, PyTorch's choice of implementation (foreach on CUDA)"
    if optim in OPTIM_NOTES:
        reading.not_modelled("optim", f"{detail}: {OPTIM_NOTES[optim]}")
    else:
        reading.used("optim", detail)
    if "versions.transformers" in reading:
        reading.used("versions.transformers", f"the Trainer's defaults of transformers "
                                              f"{'.'.join(map(str, transformers_version))}")
    return member


def _workload(reading: Reading, kind: str, model: str | None) -> tuple[str, str]:
    name = reading.get("model_name_or_path", None, types=(str, type(None)))
    revision = reading.get("model_revision", None, types=(str, type(None)))
    if name is None and model is None:
        raise UsageError(f"{kind} configuration: no model; give model_name_or_path (a Hub id or a path) in the file, "
                         "or --workload hf:<model>")
    chosen = model or name
    spec = chosen if chosen.startswith("hf:") else model_workload(chosen, "model_name_or_path")
    if revision and revision != "main" and name and not model:
        spec = f"{spec}@{revision}"
    reading.used("model_name_or_path", spec if not model else f"replaced by {model}")
    reading.used("model_revision")
    task = reading.get("task", "causal_lm" if kind == KIND_TRL else None, types=(str, type(None)), choices=(None,
                                                                                                        *TASKS))
    reading.used("task")
    attn = None
    for key in ("model_init_kwargs.attn_implementation", "attn_implementation"):
        value = reading.get(key, None, types=(str, type(None)),
                            choices=(None, "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"))
        if value is not None and attn is None:
            attn = value
            if value in ("sdpa", "eager"):
                reading.used(key, f"attn={value}")
            else:
                reading.not_modelled(key, f"{value}: predicted as sdpa (on CUDA, the flash kernel where it applies)")
    attn = attn if attn in ("eager",) else None
    reading.used("trust_remote_code")
    seq_len, packed = _sequence(reading, kind)
    loss = "model"  # Trainer.compute_loss: the model's own loss from labels=
    return hf_workload(spec, seq_len, packed=packed, loss=loss, attn=attn, task=task), name or chosen


def _sequence(reading: Reading, kind: str) -> tuple[int, int]:
    length = None
    for key in ("max_length", "max_seq_length"):
        value = reading.get(key, None, types=(int, type(None)))
        if value is not None and length is None:
            length = value
        reading.used(key)
    if length is None:
        length = DEFAULT_MAX_LENGTH
        reading.assume(f"max_length not given: {length} tokens (SFTConfig's default; a plain Trainer's sequence is "
                       "its data's: give max_length)")
    if length < 1:
        raise UsageError(f"{reading.kind} key max_length: {length}; expected a positive number of tokens")
    packing = reading.get("packing", False, types=(bool,))
    strategy = reading.get("packing_strategy", "bfd", types=(str,), choices=("bfd", "bfd_split", "wrapped"))
    documents = packed_documents(length) if packing else 0
    reading.used("packing", f"packed={documents}" if packing else "unpacked")
    reading.used("packing_strategy")
    if packing:
        reading.assume(f"packed rows of {length} tokens hold {documents} documents (the data's; the mask's size "
                       "does not depend on it)")
        if strategy == "wrapped":
            documents = 0  # wrapped packing concatenates without restarting positions: plain rows
    else:
        reading.assume(f"rows padded to max_length ({length} tokens): the longest batch predicted")
    return length, documents
