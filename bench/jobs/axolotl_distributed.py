"""axolotl's multi-GPU keys (`deepspeed`, `fsdp_config` with `fsdp_version`, the older `fsdp` list) as membench's
`zero2`/`zero3` or `fsdp`, for bench/jobs/axolotl.py.

What axolotl (at commit AXOLOTL_COMMIT) does with them:
- `deepspeed`: a DeepSpeed JSON's path, opened from the working directory (`os.path.exists(cfg.deepspeed)` in
  utils/config/__init__.py; membench also looks beside the YAML), or the mapping itself; it becomes the Trainer's
  `deepspeed` argument, whose "auto" values transformers fills from the Trainer's arguments axolotl builds
  (micro_batch_size, gradient_accumulation_steps, bf16/fp16): read by bench/jobs/deepspeed.py as for a Trainer, the
  JSON's keys accounted for as `deepspeed.*`. Under DeepSpeed accelerate adds no autocast: the engine casts the model.
  `deepspeed` with `fsdp`/`fsdp_config` is refused, as axolotl refuses it (`check_fsdp_deepspeed`);
- `fsdp_config` (its keys with or without the older `fsdp_` prefix, which axolotl strips) and `fsdp_version`
  (default 1; also `fsdp_config.fsdp_version`/`version`): accelerate's FSDP plugin through axolotl's own
  `fsdp2_prepare_model` (monkeypatch/accelerate/fsdp2.py), which keeps the loaded dtype (no float32 upcast, unlike
  accelerate's) and takes accelerate's MixedPrecisionPolicy: with bf16 (fp16) param, reduce and output dtypes
  bfloat16 (float16). `offload_params` is `fsdp:offload=cpu`, `reshard_after_forward: false`
  `fsdp:reshard_after_forward=false`, `activation_checkpointing` `checkpoint:segments=all`; version 1 is predicted as
  FSDP2 sharding the same way. The deprecated `fsdp` list (TrainingArguments.fsdp's words) is read likewise.
The processes are the launcher's (`axolotl train` / `accelerate launch`), which the file does not state: --ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.core.errors import UsageError
from bench.jobs.job import IGNORED, NOT_MODELLED, USED, Key, Reading

AXOLOTL_COMMIT = "067b021c8b87a9e5e380b9173c704cf7340e30f5"
FSDP_WORDS = {"full_shard": "", "shard_grad_op": "reshard_after_forward=false", "offload": "offload=cpu",
              "auto_wrap": "", "no_shard": None}  # TrainingArguments.fsdp's words membench predicts
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP")
_SAVE = "how checkpoints are saved or weights loaded: not the step"

KEYS = (
    Key("deepspeed", USED, "a DeepSpeed JSON (path or mapping): zero2/zero3, its keys as deepspeed.*"),
    Key("fsdp_version", USED, "2: FSDP2 (fsdp); 1 (default): predicted as FSDP2"),
    Key("fsdp", USED, "the deprecated list (full_shard, shard_grad_op, offload, auto_wrap, no_shard)"),
    Key("fsdp_config.*fsdp_version", USED, "the FSDP version, where fsdp_version is not given"),
    Key("fsdp_config.version", USED, "the FSDP version, where fsdp_version is not given"),
    Key("fsdp_config.*offload_params", USED, "fsdp:offload=cpu"),
    Key("fsdp_config.*reshard_after_forward", USED, "false: fsdp:reshard_after_forward=false"),
    Key("fsdp_config.*activation_checkpointing", USED, "checkpoint:segments=all"),
    Key("fsdp_config.*auto_wrap_policy", USED, "TRANSFORMER_BASED_WRAP: each decoder layer a unit"),
    Key("fsdp_config.*transformer_layer_cls_to_wrap", USED, "the decoder layer (membench's units)"),
    Key("fsdp_config.*min_num_params", NOT_MODELLED, "SIZE_BASED_WRAP's units: predicted as one per layer"),
    Key("fsdp_config.*mixed_precision_policy", NOT_MODELLED, "accelerate's policy from bf16/fp16 predicted"),
    Key("fsdp_config.*cpu_offload_pin_memory", IGNORED, "pinned or not, the same host bytes"),
    Key("fsdp_config.*state_dict_type", IGNORED, _SAVE),
    Key("fsdp_config.*sync_module_states", IGNORED, _SAVE),
    Key("fsdp_config.*cpu_ram_efficient_loading", IGNORED, _SAVE),
    Key("fsdp_config.*use_orig_params", IGNORED, "FSDP1's parameter views: the same bytes"),
    Key("fsdp_config.*backward_prefetch", NOT_MODELLED, "FSDP1's prefetch: FSDP2 prefetches one unit"),
    Key("fsdp_config.*forward_prefetch", NOT_MODELLED, "FSDP1's explicit forward prefetch: not predicted"),
    Key("fsdp_final_state_dict_type", IGNORED, _SAVE),
    Key("fp32_norms", NOT_MODELLED, "the norms under a float32 policy of their own: the model's policy predicted"),
    Key("fp32_norm_classes", NOT_MODELLED, "the norms under a float32 policy of their own: not predicted"),
)


def distributed_members(reading: Reading, members: list[str], micro: int, steps: int, bf16: bool, fp16: bool,
                        workload: str, source: str) -> tuple[list[str], int, int | None, list]:
    """(members, batch per device, ranks or None, the DeepSpeed JSON's key uses) once `deepspeed`, `fsdp` and
    `fsdp_config` are read; `members` as the single-device keys gave them."""
    fsdp = bool(reading.get("fsdp", None)) or any(k.startswith("fsdp_config.") for k in reading.values)
    if not fsdp:  # axolotl applies FSDP where `fsdp` or `fsdp_config` is set (prepare_optim_env)
        for key in ("fsdp", "fsdp_config", "fsdp_version"):
            reading.ignored(key, "no fsdp_config: FSDP is not applied")
    if reading.get("deepspeed", None) is not None:
        if fsdp:
            raise UsageError("axolotl keys deepspeed and fsdp/fsdp_config: axolotl refuses both together; valid: one")
        return _deepspeed(reading, members, micro, steps, bf16, fp16, workload, source)
    if fsdp:
        reading.assume("the processes: the launcher's (axolotl train, accelerate launch), not the file's: --ranks N")
        return _fsdp(reading, members, bf16, fp16), micro * steps, None, []
    return members, micro * steps, None, []


def _deepspeed(reading: Reading, members: list[str], micro: int, steps: int, bf16: bool, fp16: bool,
               workload: str, source: str) -> tuple[list[str], int, int | None, list]:
    from bench.jobs.deepspeed import Trainer, deepspeed_members, hidden_size, load_deepspeed

    value = reading.get("deepspeed", types=(str, dict))
    found = value
    if isinstance(value, str) and not Path(value).expanduser().is_file() and (Path(source).parent / value).is_file():
        found = str(Path(source).parent / value)  # beside the YAML, where the working directory has no such file
    values = load_deepspeed(found, key="axolotl key deepspeed")
    filler = Trainer(micro, steps, bf16, fp16, hidden_size(workload), filler="axolotl's (the Trainer's arguments)")
    zero, ds_micro, ds_steps, ranks, uses, assumptions = deepspeed_members(values, filler, prefix="deepspeed.")
    kept = [m for m in members if not m.startswith(("amp:", "grad_accumulation")) and m not in zero]
    reading.used("deepspeed", found if isinstance(found, str) else "the mapping (its keys as deepspeed.*)")
    for key in ("bf16", "fp16"):
        if reading.get(key):
            reading.used(key, f"DeepSpeed's {key} section's auto: the engine casts the model (no autocast)")
    if ds_micro * ds_steps != micro * steps:
        reading.assume(f"deepspeed: the JSON's batch per device ({ds_micro} x {ds_steps}) is DeepSpeed's, not "
                       f"micro_batch_size x gradient_accumulation_steps ({micro} x {steps})")
    for line in assumptions:
        reading.assume(f"deepspeed: {line}")
    if ranks is None:
        reading.assume("the processes: the launcher's (axolotl train, accelerate launch), not the file's: --ranks N")
    return kept + zero, ds_micro * ds_steps, ranks, uses


def _fsdp_key(reading: Reading, name: str) -> str:
    """The fsdp_config key as the file spells it: with or without axolotl's older `fsdp_` prefix."""
    old = f"fsdp_config.fsdp_{name}"
    return old if old in reading else f"fsdp_config.{name}"


def _fsdp(reading: Reading, members: list[str], bf16: bool, fp16: bool) -> list[str]:
    words = _fsdp_words(reading)
    keys = [k for k in ("fsdp_version", "fsdp_config.fsdp_version", "fsdp_config.version") if k in reading]
    version = reading.get(keys[0], types=(int, str)) if keys else 1  # _resolve_fsdp_version: 1 by default
    if str(version) not in ("1", "2"):
        raise UsageError(f"axolotl key {keys[0]}: unknown value {version!r}; valid choices: 1, 2")
    for key in keys:
        if str(version) == "2":
            reading.used(key, "FSDP2 (fully_shard)")
        else:
            reading.not_modelled(key, "FSDP1 (FlatParameter) predicted as FSDP2 sharding the same way")
    if not keys:
        reading.assume("fsdp_version not given: axolotl's default, 1 (FSDP1, predicted as FSDP2 sharding the same "
                       "way)")
    if words is None:
        return [m for m in members if m != "ddp"] + ["ddp"]
    options = list(words)
    dtype = "bfloat16" if bf16 else "float16" if fp16 else None
    if dtype:  # accelerate's MixedPrecisionPolicy for its mixed_precision, which axolotl sets from bf16/fp16
        options += [f"param_dtype={dtype}", f"reduce_dtype={dtype}", f"output_dtype={dtype}"]
    key = _fsdp_key(reading, "offload_params")
    if reading.get(key, False, types=(bool, type(None))) and "offload=cpu" not in options:
        options.append("offload=cpu")
    reading.used(key, "fsdp:offload=cpu" if "offload=cpu" in options else "off")
    key = _fsdp_key(reading, "reshard_after_forward")
    if reading.get(key, True, types=(bool, type(None))) is False and "reshard_after_forward=false" not in options:
        options.append("reshard_after_forward=false")
    reading.used(key, "fsdp:reshard_after_forward=false" if "reshard_after_forward=false" in options else "true")
    key = _fsdp_key(reading, "activation_checkpointing")
    checkpoint = bool(reading.get(key, False, types=(bool, type(None))))
    reading.used(key, "checkpoint:segments=all" if checkpoint else "off")
    key = _fsdp_key(reading, "auto_wrap_policy")
    policy = reading.get(key, "TRANSFORMER_BASED_WRAP", types=(str, type(None)), choices=(*WRAP_POLICIES, None))
    if policy == "SIZE_BASED_WRAP":
        reading.not_modelled(key, "SIZE_BASED_WRAP: other units than the decoder layers; predicted with each "
                                  "decoder layer a unit")
    else:
        reading.used(key)
    member = ":".join(["fsdp", *options])
    extra = ["checkpoint:segments=all"] if checkpoint and "checkpoint:segments=all" not in members else []
    return [m for m in members if m != member] + extra + [member]


def _fsdp_words(reading: Reading) -> list[str] | None:
    """The fsdp options the deprecated `fsdp` list (or a plain `fsdp: true`) asks for; None for no_shard (ddp)."""
    value: Any = reading.get("fsdp", None, types=(list, str, bool, type(None)))
    words = value.split() if isinstance(value, str) else value if isinstance(value, list) else []
    for word in words:
        if word not in FSDP_WORDS:
            raise UsageError(f"axolotl key fsdp: unknown word {word!r}; valid choices: {', '.join(FSDP_WORDS)} "
                             "(hybrid sharding's replica groups are not in axolotl's file)")
    if "fsdp" in reading:
        reading.used("fsdp", " ".join(words) or "FSDP")
    if "no_shard" in words:
        reading.used("fsdp", "no_shard: ddp")
        return None
    return [FSDP_WORDS[w] for w in words if FSDP_WORDS[w]]
