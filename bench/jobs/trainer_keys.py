"""The Trainer's and TRL's configuration keys, as data: what each does to a training step's memory (the spec member
it becomes, or why it is ignored or not modelled), the `optim` names, the dtypes and the version thresholds of the
defaults that changed, read from the installed transformers and TRL (bench.jobs.trainer reads a file with them)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from bench.jobs.job import IGNORED, NOT_MODELLED, USED, Key

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
    Key("deepspeed", USED, "DeepSpeed's configuration: its ZeRO stage (bench/jobs/deepspeed.py)"),
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


def valid_fields(kind: str) -> dict[str, Any]:
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
