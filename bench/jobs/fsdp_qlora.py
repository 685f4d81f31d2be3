"""Answer.AI's fsdp_qlora `train.py` arguments as a membench case: a YAML or JSON mapping of the arguments its command
line takes (`--model_name meta-llama/Llama-2-7b-hf --train_type qlora` as `model_name: ...`, `train_type: qlora`).

What train.py (AnswerDotAI/fsdp_qlora, the version of its March 2024 benchmarks) does with each, as membench's spec:
- `model_name`: the model; `precision: bf16` (its default) loads and trains it in bfloat16 (`bf16_weights`),
  `bf16_autocast`/`fp16_autocast` keep float32 weights under autocast (`amp`);
- `train_type`: `lora` or `qlora`/`custom_qlora` (bitsandbytes' Linear4bit, NF4 with the codes stored in the
  weights' dtype for FSDP: `qlora`) with `lora_rank`, `lora_alpha`, `lora_dropout`, `lora_target_modules` (`all`:
  k/q/v/up/down/gate projections); `full` trains every weight;
- `sharding_strategy`: `full_shard` FSDP over the ranks (`fsdp`), `shard_grad_op` (`fsdp:reshard_after_forward=
  false`), `ddp` (FSDP's NO_SHARD, predicted as `ddp`); `world_size` the ranks (-1: every GPU; the count is then
  --ranks');
- `batch_size` (per GPU) x `gradient_accumulation_steps`, `context_length` the sequence length (the `dummy` data set's
  rows are exactly that long; other data sets' batches are padded to their longest sample, at most that long);
- `use_gradient_checkpointing` (default true) every decoder layer (`checkpoint:segments=all`);
  `use_cpu_offload` (default true) FSDP's parameter offload (`fsdp:offload=cpu`); `use_activation_cpu_offload`
  (`offload`);
- `optimizer`: adamw (torch.optim.AdamW, PyTorch's implementation), adam, sgd, fused_adam/fused_adamw;
- the loss is the model's own from `labels=` (`loss=model`).
"""

from __future__ import annotations

from typing import Any

from bench.core.errors import UsageError
from bench.jobs.job import IGNORED, NOT_MODELLED, USED, DerivedJob, Key, Reading, hf_workload, spec_of
from bench.jobs.models import model_workload

KIND = "fsdp_qlora"
ALL_TARGETS = "k_proj/q_proj/v_proj/up_proj/down_proj/gate_proj"  # train.py's lora_target_modules=all
PRECISIONS = {"bf16": ["bf16_weights"], "fp32": [], "bf16_autocast": ["amp:dtype=bfloat16"],
              "fp16_autocast": ["amp:dtype=float16"], "bf16_buffers_autocast": ["bf16_weights", "amp:dtype=bfloat16"]}
SHARDING = {"full_shard": "fsdp", "shard_grad_op": "fsdp:reshard_after_forward=false", "ddp": "ddp"}
OPTIMIZERS = {"adamw": "", "adam": "optimizer:name=adam", "sgd": "optimizer:name=sgd",
              "fused_adam": "optimizer:name=adam:impl=fused", "fused_adamw": "optimizer:impl=fused"}
TRAIN_TYPES = ("full", "lora", "qlora", "custom_qlora")
_HOST = "logging, saving, loading or launching: does not change a step's memory"

KEYS = (
    Key("model_name", USED, "the model: hf:<Hub id or path>"),
    Key("train_type", USED, "full, lora or qlora"),
    Key("precision", USED, "bf16: bf16_weights; *_autocast: amp"),
    Key("batch_size", USED, "the batch per GPU, times gradient_accumulation_steps"),
    Key("gradient_accumulation_steps", USED, "grad_accumulation:micro_batches"),
    Key("context_length", USED, "the workload's seq_len"),
    Key("dataset", USED, "dummy: rows of exactly context_length tokens; others padded to their longest"),
    Key("sharding_strategy", USED, "fsdp (full_shard), fsdp:reshard_after_forward=false (shard_grad_op), ddp"),
    Key("world_size", USED, "the ranks"),
    Key("use_gradient_checkpointing", USED, "checkpoint:segments=all"),
    Key("reentrant_checkpointing", USED, "reentrant or not: the same layer inputs saved"),
    Key("use_cpu_offload", USED, "fsdp:offload=cpu"),
    Key("use_activation_cpu_offload", USED, "offload"),
    Key("lora_rank", USED, "lora:r"), Key("lora_alpha", USED, "lora:alpha"),
    Key("lora_dropout", USED, "lora:dropout"), Key("lora_target_modules", USED, "lora:targets"),
    Key("optimizer", USED, "the optimizer"),
    Key("apply_gradient_clipping", NOT_MODELLED, "gradient clipping's norm: small temporaries, not counted"),
    Key("grad_norm", NOT_MODELLED, "gradient clipping's norm: small temporaries, not counted"),
    Key("no_sync", NOT_MODELLED, "gradients accumulated without syncing: as with syncing"),
    Key("profile_memory", NOT_MODELLED, "the memory profiler's history: not counted"),
    Key("low_memory", IGNORED, "how the weights are loaded before training: not the step"),
    Key("loading_workers", IGNORED, "how the weights are loaded before training: not the step"),
    Key("dataset_samples", IGNORED, "how many samples: each step is the same"),
    Key("num_epochs", IGNORED, "how long training lasts"),
    Key("lr", IGNORED, "a hyperparameter: values"), Key("wd", IGNORED, "a hyperparameter: values"),
    Key("lr_scheduler", IGNORED, "the learning-rate schedule holds no tensors"),
    Key("seed", IGNORED, "values, not memory"), Key("verbose", IGNORED, _HOST), Key("log_to", IGNORED, _HOST),
    Key("save_model", IGNORED, _HOST), Key("output_dir", IGNORED, _HOST), Key("master_addr", IGNORED, _HOST),
    Key("master_port", IGNORED, _HOST), Key("project_name", IGNORED, _HOST), Key("name", IGNORED, _HOST),
    Key("group", IGNORED, _HOST), Key("entity", IGNORED, _HOST),
)


def read_fsdp_qlora(values: dict[str, Any], source: str, overrides: tuple[str, ...] = (),
                    model: str | None = None) -> DerivedJob:
    """The DerivedJob of fsdp_qlora's train.py arguments (a mapping, overrides applied)."""
    reading = Reading(KIND, values, KEYS)
    members: list[str] = []
    precision = reading.get("precision", "bf16", types=(str,), choices=PRECISIONS)
    members += PRECISIONS[precision]
    reading.used("precision", "+".join(PRECISIONS[precision]) or "float32")
    train_type = reading.get("train_type", "lora", types=(str,), choices=TRAIN_TYPES)
    if train_type != "full":
        rank = reading.get("lora_rank", 64, types=(int,))
        alpha = reading.get("lora_alpha", 16, types=(int, float))
        dropout = reading.get("lora_dropout", 0.1, types=(int, float))
        targets = reading.get("lora_target_modules", "all", types=(str,), choices=("all", "default"))
        targets = ALL_TARGETS if targets == "all" else "auto"
        alpha_text = int(alpha) if float(alpha).is_integer() else alpha
        kind = "lora" if train_type == "lora" else "qlora"
        members.append(f"{kind}:r={rank}:alpha={alpha_text}" + (f":dropout={dropout}" if dropout else "")
                       + f":targets={targets}")
        for key in ("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules"):
            reading.used(key)
    reading.used("train_type", "a full fine-tune" if train_type == "full" else members[-1].split(":")[0])
    if reading.get("use_gradient_checkpointing", True, types=(bool,)):
        members.append("checkpoint:segments=all")
    reading.used("use_gradient_checkpointing", "checkpoint:segments=all" if "checkpoint:segments=all" in members
                 else "off")
    if reading.get("reentrant_checkpointing", False, types=(bool,)):
        reading.not_modelled("reentrant_checkpointing", "reentrant checkpointing predicted as non-reentrant: the "
                                                        "same layer inputs saved")
    sharding = reading.get("sharding_strategy", "full_shard", types=(str,), choices=SHARDING)
    member = SHARDING[sharding]
    if reading.get("use_cpu_offload", True, types=(bool,)):
        if sharding == "ddp":
            raise UsageError("fsdp_qlora keys use_cpu_offload=true and sharding_strategy=ddp: FSDP's CPU offload "
                             "needs a sharded strategy; valid: use_cpu_offload: false")
        member += ":offload=cpu"
    members.append(member)
    reading.used("use_cpu_offload", "fsdp:offload=cpu" if member.endswith(":offload=cpu") else "off")
    if sharding == "ddp":
        reading.not_modelled("sharding_strategy", "FSDP's NO_SHARD predicted as DistributedDataParallel (replicated "
                                                  "weights and gradients alike; DDP's buckets for FSDP's flat gradient)")
    else:
        reading.used("sharding_strategy", member)
    if reading.get("use_activation_cpu_offload", False, types=(bool,)):
        members.append("offload")
    reading.used("use_activation_cpu_offload", "offload" if "offload" in members else "off")
    optimizer = reading.get("optimizer", "adamw", types=(str,), choices=OPTIMIZERS)
    members.append(OPTIMIZERS[optimizer])
    reading.used("optimizer", OPTIMIZERS[optimizer] or "torch.optim.AdamW, PyTorch's implementation")
    micro = reading.get("batch_size", 1, types=(int,))
    steps = reading.get("gradient_accumulation_steps", 1, types=(int,))
    if micro < 1 or steps < 1:
        raise UsageError(f"fsdp_qlora keys batch_size={micro}, gradient_accumulation_steps={steps}: each must be a "
                         "positive integer")
    if steps > 1:
        members.append(f"grad_accumulation:micro_batches={steps}")
    reading.used("batch_size", f"batch per GPU {micro * steps} ({micro} x {steps})")
    reading.used("gradient_accumulation_steps")
    world = reading.get("world_size", -1, types=(int,))
    ranks = world if world > 0 else None
    if ranks is None:
        reading.assume("world_size -1 (every GPU): the ranks are --ranks'")
    reading.used("world_size", f"{ranks} ranks" if ranks else "every GPU: --ranks")
    seq_len = reading.get("context_length", 512, types=(int,))
    dataset = reading.get("dataset", "alpaca_sample", types=(str,))
    if dataset != "dummy":
        reading.assume(f"dataset {dataset}: batches padded to their longest sample, at most context_length; the "
                       f"longest, {seq_len} tokens, predicted")
    reading.used("context_length", f"seq_len={seq_len}")
    reading.used("dataset")
    name = reading.get("model_name", "meta-llama/Llama-2-7b-hf", types=(str,))
    chosen = model or name
    spec = chosen if chosen.startswith("hf:") else model_workload(chosen, "model_name")
    reading.used("model_name", spec if not model else f"replaced by {model}")
    return DerivedJob(kind=KIND, source=source, overrides=overrides, model=name,
                      workload=hf_workload(spec, seq_len, loss="model"), strategy=spec_of(members),
                      batch_size=micro * steps, ranks=ranks, keys=reading.finish(), assumptions=reading.assumptions)
