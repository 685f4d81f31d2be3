"""axolotl's YAML configuration (the file `axolotl train config.yml` takes) as a membench case.

axolotl builds transformers' TrainingArguments and a peft model from its keys; what membench does with each:
- `base_model` (a Hub id or a path): the model; `bf16: true` (or `auto`) loads it in bfloat16 and trains under
  bfloat16 autocast (`bf16_weights+amp:dtype=bfloat16`), `fp16: true` autocast in float16 on float32 weights;
- `adapter: lora` / `qlora` (with `load_in_4bit`): `lora`/`qlora` with `lora_r`, `lora_alpha`, `lora_dropout`,
  `lora_target_modules` or `lora_target_linear: true` (every linear layer but the head: all-linear);
- `sequence_len`: the workload's seq_len; `sample_packing`: rows packed to sequence_len (`packed`);
- `micro_batch_size` x `gradient_accumulation_steps`: one step's batch per device (`grad_accumulation`);
- `gradient_checkpointing: true` every decoder layer (`checkpoint:segments=all`); `offload`: their inputs in pinned
  host memory too (`offload`);
- `flash_attention`/`sdp_attention`: SDPA (flash attention's kernel is predicted as SDPA's); `xformers_attention`
  likewise; none: transformers' default, SDPA;
- `optimizer`: the Trainer's `optim` names (default adamw_torch_fused, axolotl PR #2425);
- `torch_compile`: the model compiled whole (`compile`);
- `deepspeed`, `fsdp_config`/`fsdp_version` (and the older `fsdp` list): `zero2`/`zero3` or `fsdp`, as
  bench/jobs/axolotl_distributed.py says; the ranks are the launcher's (--ranks).
"""

from __future__ import annotations

from typing import Any

from bench.core.errors import UsageError
from bench.jobs import axolotl_distributed
from bench.jobs.job import (IGNORED, NOT_MODELLED, USED, DerivedJob, Key, Reading, hf_workload, packed_documents,
                            spec_of)
from bench.jobs.models import model_workload
from bench.jobs.trainer_keys import OPTIM_NOTES, OPTIMS

KIND = "axolotl"
DEFAULT_OPTIMIZER = "adamw_torch_fused"  # axolotl PR #2425: the Trainer's fused AdamW where none is given
DEFAULT_SEQUENCE_LEN = 2048  # axolotl's default sequence_len
_HOST = "host-side (data, logging, saving, evaluation, the Hub): does not change a step's memory"

KEYS = (
    Key("base_model", USED, "the model: hf:<Hub id or path>"),
    Key("base_model_config", USED, "the model's configuration (in place of base_model's)"),
    Key("revision_of_model", USED, "the model's revision: hf:<id>@revision"),
    Key("model_type", IGNORED, "the AutoModel class: a causal LM"),
    Key("tokenizer_*", IGNORED, _HOST),
    Key("trust_remote_code", USED, "passed to the workload's configuration"),
    Key("adapter", USED, "lora or qlora"),
    Key("lora_r", USED, "lora:r"), Key("lora_alpha", USED, "lora:alpha"), Key("lora_dropout", USED, "lora:dropout"),
    Key("lora_target_modules", USED, "lora:targets"), Key("lora_target_linear", USED, "lora:targets=all-linear"),
    Key("lora_fan_in_fan_out", IGNORED, "the layout of Conv1D weights: the same adapters"),
    Key("lora_model_dir", IGNORED, "where adapters are loaded from: the same adapters"),
    Key("lora_modules_to_save", NOT_MODELLED, "fully trained copies of these modules: not predicted"),
    Key("peft_use_dora", NOT_MODELLED, "DoRA's magnitude vectors: predicted as LoRA"),
    Key("peft_use_rslora", IGNORED, "rank-stabilised scaling: the same tensors"),
    Key("load_in_4bit", USED, "the base weights in NF4 (qlora)"),
    Key("load_in_8bit", USED, "refused: membench has no 8-bit weights"),
    Key("bnb_config_kwargs", NOT_MODELLED, "BitsAndBytesConfig's extra arguments: nf4, double quantisation"),
    Key("sequence_len", USED, "the workload's seq_len"),
    Key("sample_packing", USED, "packed documents per row"),
    Key("pad_to_sequence_len", USED, "rows padded to sequence_len (predicted so in any case: the longest batch)"),
    Key("eval_sample_packing", IGNORED, "evaluation only"),
    Key("micro_batch_size", USED, "the batch per device, times gradient_accumulation_steps"),
    Key("gradient_accumulation_steps", USED, "grad_accumulation:micro_batches"),
    Key("batch_size", USED, "the batch per device, where micro_batch_size is not given"),
    Key("gradient_checkpointing", USED, "checkpoint:segments=all (offload: +offload)"),
    Key("gradient_checkpointing_kwargs.use_reentrant", NOT_MODELLED, "reentrant or not: predicted non-reentrant, "
                                                                     "the same layer inputs saved"),
    Key("gradient_checkpointing_kwargs", NOT_MODELLED, "checkpoint() arguments: non-reentrant predicted"),
    Key("activation_offloading", USED, "offload_activations"),
    Key("bf16", USED, "bfloat16 weights and autocast (bf16_weights+amp:dtype=bfloat16)"),
    Key("bfloat16", USED, "bfloat16 weights (bf16_weights)"),
    Key("fp16", USED, "float16 autocast (amp:dtype=float16)"),
    Key("float16", USED, "refused: float16 weights are not predicted"),
    Key("tf32", IGNORED, "TensorFloat-32 matmuls: precision, not memory"),
    Key("flash_attention", NOT_MODELLED, "flash-attention 2: predicted as SDPA (on CUDA its flash kernel where "
                                         "it applies)"),
    Key("sdp_attention", USED, "attn=sdpa"),
    Key("xformers_attention", NOT_MODELLED, "xformers' attention: predicted as SDPA"),
    Key("eager_attention", USED, "attn=eager"),
    Key("flash_attn_*", NOT_MODELLED, "flash-attention's fused kernels: transformers' own predicted"),
    Key("optimizer", USED, "the optimizer (the Trainer's optim names)"),
    Key("torch_compile", USED, "compile (the model compiled whole)"),
    Key("torch_compile_backend", NOT_MODELLED, "inductor predicted"),
    Key("torch_compile_mode", NOT_MODELLED, "inductor's default mode predicted"),
    Key("plugins", NOT_MODELLED, "axolotl plugins (Liger, cut cross-entropy): not predicted; name their effect "
                                 "with --strategies"),
    Key("liger_*", NOT_MODELLED, "Liger's kernels: transformers' own predicted"),
    Key("cut_cross_entropy", NOT_MODELLED, "cut cross-entropy: the whole logits predicted"),
    Key("max_grad_norm", NOT_MODELLED, "gradient clipping's norm: small temporaries, not counted"),
    Key("neftune_noise_alpha", NOT_MODELLED, "noise on the embeddings' output: one tensor, not counted"),
    *axolotl_distributed.KEYS,
    Key("learning_rate", IGNORED, "a hyperparameter: values, not memory"),
    Key("lr_scheduler", IGNORED, "the learning-rate schedule holds no tensors"),
    Key("lr_*", IGNORED, "the learning-rate schedule holds no tensors"),
    Key("cosine_*", IGNORED, "the learning-rate schedule holds no tensors"),
    Key("warmup_*", IGNORED, "the learning-rate schedule holds no tensors"),
    Key("weight_decay", IGNORED, "a hyperparameter: values"), Key("adam_*", IGNORED, "a hyperparameter: values"),
    Key("optim_args", NOT_MODELLED, "extra optimizer arguments: defaults assumed"),
    Key("num_epochs", IGNORED, "how long training lasts"), Key("max_steps", IGNORED, "how long training lasts"),
    Key("datasets", IGNORED, _HOST), Key("test_datasets", IGNORED, _HOST), Key("dataset_*", IGNORED, _HOST),
    Key("val_set_size", IGNORED, _HOST), Key("output_dir", IGNORED, _HOST), Key("chat_template", IGNORED, _HOST),
    Key("special_tokens", IGNORED, _HOST), Key("tokens", IGNORED, _HOST), Key("train_on_inputs", IGNORED, _HOST),
    Key("group_by_length", IGNORED, _HOST), Key("wandb_*", IGNORED, _HOST), Key("mlflow_*", IGNORED, _HOST),
    Key("logging_steps", IGNORED, _HOST), Key("evals_per_epoch", IGNORED, _HOST), Key("eval_*", IGNORED, _HOST),
    Key("saves_per_epoch", IGNORED, _HOST), Key("save_*", IGNORED, _HOST), Key("hub_*", IGNORED, _HOST),
    Key("resume_from_checkpoint", IGNORED, _HOST), Key("auto_resume_from_checkpoints", IGNORED, _HOST),
    Key("early_stopping_patience", IGNORED, _HOST), Key("local_rank", IGNORED, "set by the launcher"),
    Key("strict", IGNORED, "axolotl's config validation"), Key("debug", IGNORED, _HOST),
    Key("seed", IGNORED, "values, not memory"), Key("shuffle_merged_datasets", IGNORED, _HOST),
    Key("loss_watchdog_*", IGNORED, _HOST), Key("label_names", IGNORED, _HOST), Key("evaluation_strategy", IGNORED,
                                                                                    _HOST),
    Key("xformers_*", NOT_MODELLED, "xformers' kernels: predicted as SDPA"),
    Key("gpu_memory_limit", IGNORED, "a loading cap: membench predicts the step's need"),
    Key("lora_on_cpu", IGNORED, "where adapters are merged: not the training step"),
    Key("unsloth_*", NOT_MODELLED, "unsloth's kernels: transformers' own predicted"),
    Key("ddp_*", NOT_MODELLED, "DDP's settings: one device predicted"),
    Key("dataloader_*", IGNORED, _HOST), Key("use_wandb", IGNORED, _HOST), Key("sequence_parallel_degree",
                                                                               NOT_MODELLED, "one device predicted"),
)


def read_axolotl(values: dict[str, Any], source: str, overrides: tuple[str, ...] = (),
                 model: str | None = None) -> DerivedJob:
    """The DerivedJob of an axolotl configuration (a mapping, overrides applied); `model`: the workload's model
    where the configuration's base_model is not to be read (a preset, a config.json path)."""
    reading = Reading(KIND, values, KEYS, nested=("fsdp_config",))
    members = []
    bf16 = reading.get("bf16", False, types=(bool, str))
    if isinstance(bf16, str) and bf16 != "auto":
        raise UsageError(f"axolotl key bf16: unknown value {bf16!r}; valid choices: true, false, auto")
    bf16 = bf16 is True or bf16 == "auto"
    fp16 = reading.get("fp16", False, types=(bool, type(None))) or False
    if bf16 and fp16:
        raise UsageError("axolotl keys bf16 and fp16: both on; valid: one of them")
    if reading.get("float16", False, types=(bool,)):
        raise UsageError("axolotl key float16: float16 weights are not predicted by membench; valid: bf16 or fp16 "
                         "(autocast on float32 weights)")
    if bf16 or reading.get("bfloat16", False, types=(bool,)):
        members.append("bf16_weights")
    if bf16:
        members.append("amp:dtype=bfloat16")
        if reading.get("bf16") == "auto":
            reading.assume("bf16: auto: a GPU with bfloat16 (Ampere or later) assumed")
    if fp16:
        members.append("amp:dtype=float16")
    reading.used("bf16", "bf16_weights+amp:dtype=bfloat16" if bf16 else "off")
    reading.used("fp16", "amp:dtype=float16" if fp16 else "off")
    adapter = _adapter(reading)
    if adapter and "bf16_weights" in members:
        reading.assume("peft's get_peft_model keeps the adapters in float32 on a bfloat16 model "
                       "(autocast_adapter_dtype=True): predicted in bfloat16 with the weights (not modelled)")
    members += adapter
    checkpointing = reading.get("gradient_checkpointing", False, types=(bool, str, type(None)))
    if checkpointing not in (None, False, True, "offload", "unsloth"):
        raise UsageError(f"axolotl key gradient_checkpointing: unknown value {checkpointing!r}; valid choices: true, "
                         "false, offload, unsloth")
    if checkpointing:
        members.append("checkpoint:segments=all")
        if checkpointing in ("offload", "unsloth"):
            members.append("offload")
    reading.used("gradient_checkpointing", members[-1] if checkpointing else "off")
    if reading.get("activation_offloading", False, types=(bool,)):
        members.append("offload_activations")
    optim = reading.get("optimizer", DEFAULT_OPTIMIZER, types=(str,), choices=[o for o in OPTIMS if o != "adamw_hf"])
    members.append(OPTIMS[optim])
    detail = OPTIMS[optim] or "the workload's AdamW (foreach on CUDA)"
    if optim in OPTIM_NOTES:
        reading.not_modelled("optimizer", f"{detail}: {OPTIM_NOTES[optim]}")
    else:
        reading.used("optimizer", detail)
    if "optimizer" not in values:
        reading.assume(f"optimizer not given: axolotl's default, {DEFAULT_OPTIMIZER}")
    if reading.get("torch_compile", False, types=(bool, str)) is True:
        members.append("compile")
    micro = reading.get("micro_batch_size", reading.get("batch_size", 1, types=(int,)), types=(int,))
    steps = reading.get("gradient_accumulation_steps", 1, types=(int,))
    if micro < 1 or steps < 1:
        raise UsageError(f"axolotl keys micro_batch_size={micro}, gradient_accumulation_steps={steps}: each must be a "
                         "positive integer")
    if steps > 1:
        members.append(f"grad_accumulation:micro_batches={steps}")
    reading.used("micro_batch_size", f"batch per device {micro * steps} ({micro} x {steps})")
    reading.used("gradient_accumulation_steps", f"grad_accumulation:micro_batches={steps}" if steps > 1 else "one")
    workload, name = _workload(reading, model)
    members, batch, ranks, deepspeed_uses = axolotl_distributed.distributed_members(
        reading, members, micro, steps, bf16, fp16, workload, source)
    return DerivedJob(kind=KIND, source=source, overrides=overrides, workload=workload, model=name,
                      strategy=spec_of(members), batch_size=batch, ranks=ranks,
                      keys=reading.finish() + deepspeed_uses, assumptions=reading.assumptions)


def _adapter(reading: Reading) -> list[str]:
    adapter = reading.get("adapter", None, types=(str, type(None)), choices=(None, "lora", "qlora"))
    four_bit = reading.get("load_in_4bit", False, types=(bool, type(None))) or False
    if reading.get("load_in_8bit", False, types=(bool, type(None))):
        raise UsageError("axolotl key load_in_8bit: 8-bit weights (LLM.int8) are not predicted by membench; valid: "
                         "load_in_4bit with adapter: qlora, or neither")
    if adapter == "qlora" and not four_bit:
        raise UsageError("axolotl keys adapter: qlora needs load_in_4bit: true (axolotl refuses it otherwise)")
    if four_bit and adapter is None:
        raise UsageError("axolotl key load_in_4bit: a 4-bit model trains only adapters; valid: adapter: qlora")
    reading.used("load_in_4bit", "the base weights in NF4" if four_bit else "off")
    reading.used("load_in_8bit", "off")
    if adapter is None:
        reading.used("adapter", "none: a full fine-tune")
        return []
    rank = reading.get("lora_r", 8, types=(int,))
    alpha = reading.get("lora_alpha", 16, types=(int, float))
    dropout = reading.get("lora_dropout", 0.0, types=(int, float, type(None))) or 0.0
    modules = reading.get("lora_target_modules", None, types=(list, str, type(None)))
    linear = reading.get("lora_target_linear", False, types=(bool, type(None)))
    if linear:
        targets = "all-linear"
    elif modules:
        targets = modules if isinstance(modules, str) else "/".join(modules)
    else:
        targets = "auto"
        reading.assume("no lora_target_modules: peft's default modules of the architecture (q_proj/v_proj for Llama)")
    alpha_text = int(alpha) if float(alpha).is_integer() else alpha
    kind = "qlora" if adapter == "qlora" else "lora"
    for key in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_linear"):
        reading.used(key)
    reading.used("adapter", kind)
    if kind == "qlora":
        reading.not_modelled("adapter", "qlora; peft's prepare_model_for_kbit_training, which axolotl calls, casts the "
                                        "unquantised weights (embeddings, norms, head) to float32: predicted in the "
                                        "loading dtype")
    options = f"r={rank}:alpha={alpha_text}" + (f":dropout={dropout}" if dropout else "") + f":targets={targets}"
    return [f"{kind}:{options}"]


def _workload(reading: Reading, model: str | None) -> tuple[str, str]:
    name = reading.get("base_model_config", None, types=(str, type(None))) or reading.get("base_model", None,
                                                                                          types=(str, type(None)))
    if name is None and model is None:
        raise UsageError("axolotl configuration: no base_model; give base_model (a Hub id or a path) or --workload "
                         "hf:<model>")
    chosen = model or name
    spec = chosen if chosen.startswith("hf:") else model_workload(chosen, "base_model")
    revision = reading.get("revision_of_model", None, types=(str, type(None)))
    if revision and not model:
        spec = f"{spec}@{revision}"
    for key in ("base_model", "base_model_config", "revision_of_model"):
        reading.used(key, spec if not model else f"replaced by {model}")
    reading.used("trust_remote_code")
    seq_len = reading.get("sequence_len", DEFAULT_SEQUENCE_LEN, types=(int,))
    if "sequence_len" not in reading:
        reading.assume(f"sequence_len not given: axolotl's default, {seq_len}")
    packing = reading.get("sample_packing", False, types=(bool, type(None))) or False
    documents = packed_documents(seq_len) if packing else 0
    reading.used("sequence_len", f"seq_len={seq_len}")
    reading.used("sample_packing", f"packed={documents}" if packing else "unpacked")
    if packing:
        reading.assume(f"packed rows of {seq_len} tokens hold {documents} documents (the data's)")
    else:
        reading.assume(f"rows of sequence_len ({seq_len} tokens): the longest batch predicted")
    attn = "eager" if reading.get("eager_attention", False, types=(bool, type(None))) else None
    reading.used("eager_attention", "attn=eager" if attn else "off")
    return hf_workload(spec, seq_len, packed=documents, loss="model", attn=attn), name or chosen
