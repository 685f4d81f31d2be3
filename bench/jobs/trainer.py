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

from pathlib import Path
from typing import Any

from bench.core.errors import UsageError
from bench.jobs.job import DerivedJob, Reading, hf_workload, packed_documents, spec_of
from bench.jobs.models import model_workload
from bench.jobs.trainer_keys import (DEFAULT_MAX_LENGTH, DTYPES, KEYS, KIND_TRAINER, KIND_TRL, OPTIM_NOTES, OPTIMS,
                                     SECTIONS, TASKS, TORCH_SET_TO_NONE_FROM, TRANSFORMERS_ADAMW_HF_UNTIL, TRL_ONLY,
                                     valid_fields)


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
    defaults = valid_fields(kind)
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
    ranks, deepspeed_uses = None, []
    if reading.get("deepspeed", None) is not None:
        members, ranks, deepspeed_uses = _deepspeed(reading, members, micro, steps, workload, source)
    keys = [use for use in reading.finish(defaults) if not (deepspeed_uses and use.key == "deepspeed")]
    return DerivedJob(kind=kind, source=source, overrides=overrides, workload=workload, model=model_name,
                      strategy=spec_of(members), batch_size=micro * steps, ranks=ranks,
                      keys=keys + deepspeed_uses, assumptions=reading.assumptions)


def _deepspeed(reading: Reading, members: list[str], micro: int, steps: int, workload: str, source: str):
    """(members, ranks, key uses) of a Trainer run under DeepSpeed (its `deepspeed` key: a path or a mapping): the
    ZeRO stage and precision are DeepSpeed's (the engine casts the model for bf16/fp16; accelerate adds no autocast
    under DeepSpeed), "auto" filled from the Trainer (bench/jobs/deepspeed.py)."""
    from bench.jobs.deepspeed import Trainer, deepspeed_members, hidden_size, load_deepspeed

    value = reading.get("deepspeed")
    beside = Path(source).parent / str(value)
    if isinstance(value, str) and not Path(value).expanduser().exists() and beside.is_file():
        value = str(beside)  # a path relative to the configuration's own folder
    values = load_deepspeed(value)
    bf16 = "amp:dtype=bfloat16" in members
    fp16 = "amp:dtype=float16" in members
    trainer = Trainer(micro, steps, bf16, fp16, hidden_size(workload))
    zero, _, _, ranks, uses, assumptions = deepspeed_members(values, trainer, prefix="deepspeed.")
    kept = [m for m in members if not m.startswith(("amp:", "grad_accumulation")) and m not in zero]
    for key in ("bf16", "fp16"):
        if reading.get(key):
            reading.used(key, f"DeepSpeed's {key} section's auto: the engine casts the model (no autocast)")
    for line in assumptions:
        reading.assume(f"deepspeed: {line}")
    return kept + zero, ranks, uses


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
