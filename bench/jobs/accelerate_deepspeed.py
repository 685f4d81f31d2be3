"""accelerate's DeepSpeed plugin (`distributed_type: DEEPSPEED` and its `deepspeed_config:` section) as the ZeRO
strategy bench/jobs/deepspeed.py derives from a DeepSpeed configuration JSON.

What accelerate 1.15 does with the section (`accelerate launch` turns its keys into ACCELERATE_* variables,
`DeepSpeedPlugin.__post_init__` in accelerate/utils/dataclasses.py reads them):
- `deepspeed_config_file`: the DeepSpeed JSON, opened relative to the working directory (membench also looks beside
  the YAML); its keys are read as bench/jobs/deepspeed.py reads them, with "auto" filled as
  `Accelerator._prepare_deepspeed` fills it: the micro batch from the script's dataloader (--batch-size), the
  accumulation steps from the script's Accelerator (1), bf16/fp16 from `accelerate launch --mixed_precision` (no),
  the bucket sizes from the model's hidden size. Beside it accelerate refuses the keys the file decides
  (FILE_DECIDES, `_deepspeed_config_checks`) and a `mixed_precision` from the YAML, and so does membench;
- otherwise the plugin writes the JSON itself: `zero_stage` (default 2), `offload_optimizer_device` and
  `offload_param_device` (none, cpu, nvme), `gradient_accumulation_steps` (default: the script's Accelerator's),
  `gradient_clipping`, `zero3_save_16bit_model`, with `train_micro_batch_size_per_gpu` "auto" (the script's batch)
  and `bf16`/`fp16` enabled by `mixed_precision` (`set_mixed_precision`: fp8 enables bf16); that JSON is read as
  above, so both routes give the strategy a DeepSpeed JSON of the same content gives;
- accelerate adds no autocast under DeepSpeed (`Accelerator.__init__`: native_amp stays off): the engine casts the
  model to 16 bits and keeps float32 masters (`bf16_weights` before `zero2`/`zero3`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.core.errors import UsageError
from bench.jobs.deepspeed import Trainer, deepspeed_members, hidden_size, load_deepspeed
from bench.jobs.job import IGNORED, NOT_MODELLED, USED, Key, Reading

SECTION = "deepspeed_config"
DEFAULT_STAGE = 2  # DeepSpeedPlugin.__post_init__: ACCELERATE_DEEPSPEED_ZERO_STAGE, else 2
STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")  # `accelerate config`'s choices
PREDICTED_OFFLOAD_DEVICES = ("none", "cpu")
# the plugin's keys a deepspeed_config_file decides: accelerate refuses them beside one (_deepspeed_config_checks)
FILE_DECIDES = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
                "offload_param_device", "offload_param_nvme_path", "offload_optimizer_nvme_path",
                "zero3_save_16bit_model")
FILE_PREFIX = "deepspeed_config_file."  # the JSON's keys as the accounting names them
_LAUNCH = "launching on several machines: does not change a step's memory"

KEYS = (
    Key(f"{SECTION}.deepspeed_config_file", USED, "the DeepSpeed JSON, read key by key (deepspeed_config_file.*)"),
    Key(f"{SECTION}.zero_stage", USED, "zero2 or zero3 (0 and 1: ddp and zero1, not modelled)"),
    Key(f"{SECTION}.offload_optimizer_device", USED, "offload_optimizer=cpu (nvme refused)"),
    Key(f"{SECTION}.offload_param_device", USED, "zero3:offload_param=cpu (nvme refused)"),
    Key(f"{SECTION}.offload_optimizer_nvme_path", IGNORED, "NVMe offload's folder: used only with nvme"),
    Key(f"{SECTION}.offload_param_nvme_path", IGNORED, "NVMe offload's folder: used only with nvme"),
    Key(f"{SECTION}.gradient_accumulation_steps", USED, "grad_accumulation:micro_batches"),
    Key(f"{SECTION}.gradient_clipping", NOT_MODELLED, "the norm's temporaries: not counted"),
    Key(f"{SECTION}.zero3_init_flag", IGNORED, "deepspeed.zero.Init builds the model already partitioned: loading, "
                                               "not the step"),
    Key(f"{SECTION}.zero3_save_16bit_model", IGNORED, "how checkpoints are saved: not the step"),
    Key(f"{SECTION}.deepspeed_moe_layer_cls_names", NOT_MODELLED, "ZeRO-3 leaf modules (each MoE block gathered "
                                                                  "whole): gathered module by module predicted"),
    Key(f"{SECTION}.deepspeed_multinode_launcher", IGNORED, _LAUNCH),
    Key(f"{SECTION}.deepspeed_hostfile", IGNORED, _LAUNCH),
    Key(f"{SECTION}.deepspeed_exclusion_filter", IGNORED, _LAUNCH),
    Key(f"{SECTION}.deepspeed_inclusion_filter", IGNORED, _LAUNCH),
)


def deepspeed_plugin_members(reading: Reading, processes: int, batch: int, source: str,
                             workload: str) -> tuple[list[str], list, int]:
    """(strategy members, the DeepSpeed JSON's own key uses, the batch per device: micro-batch x accumulation) of
    accelerate's DeepSpeed plugin, read from `reading` (an accelerate config whose distributed_type is DEEPSPEED) on
    `processes` ranks, the script's micro-batch `batch` where the JSON says "auto"."""
    keys = [key.removeprefix(SECTION + ".") for key in reading.values if key.startswith(SECTION + ".")]
    hidden = hidden_size(workload)
    if "deepspeed_config_file" in keys:
        return _from_file(reading, keys, processes, batch, source, hidden)
    precision = _mixed_precision(reading)
    stage = reading.get(f"{SECTION}.zero_stage", DEFAULT_STAGE, types=(int,), choices=STAGES)
    if f"{SECTION}.zero_stage" not in reading:
        reading.assume(f"{SECTION}.zero_stage not given: accelerate's default, {DEFAULT_STAGE}")
    devices = {}
    for name in ("offload_optimizer_device", "offload_param_device"):
        device = reading.get(f"{SECTION}.{name}", "none", types=(str,), choices=OFFLOAD_DEVICES)
        if device == "nvme":
            raise UsageError(f"accelerate key {SECTION}.{name}=nvme: NVMe offload is not predicted by membench; "
                             f"valid choices: {', '.join(PREDICTED_OFFLOAD_DEVICES)}")
        devices[name] = device
    steps = reading.get(f"{SECTION}.gradient_accumulation_steps", None, types=(int, type(None)))
    if steps is not None and steps < 1:
        raise UsageError(f"accelerate key {SECTION}.gradient_accumulation_steps={steps}: valid: a positive integer")
    clipping = reading.get(f"{SECTION}.gradient_clipping", None, types=(int, float, type(None)))
    # the JSON DeepSpeedPlugin.__post_init__ writes, with set_mixed_precision's bf16/fp16 sections
    values: dict[str, Any] = {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto" if steps is None else steps,
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": devices["offload_optimizer_device"]},
                              "offload_param": {"device": devices["offload_param_device"]}},
        "bf16": {"enabled": precision in ("bf16", "fp8")}, "fp16": {"enabled": precision == "fp16"}}
    if clipping:
        values["gradient_clipping"] = clipping
    zero, micro, accumulated, _, _, assumptions = deepspeed_members(values, _filler(batch, steps or 1, hidden))
    if steps is None:
        reading.assume("gradient_accumulation_steps not given: the training script's Accelerator's, 1")
    for line in assumptions:
        reading.assume(f"deepspeed: {line}")
    stage_member = next((m for m in zero if m.split(":")[0] in ("zero2", "zero3", "zero1", "ddp")), "")
    (reading.used if stage >= 2 else reading.not_modelled)(
        f"{SECTION}.zero_stage", stage_member if stage >= 2 else f"stage {stage}: predicted as {stage_member}")
    for name, least in (("offload_optimizer", 2), ("offload_param", 3)):
        device = devices[f"{name}_device"]
        if device == "cpu" and name == "offload_param" and stage < least:
            reading.ignored(f"{SECTION}.{name}_device", f"ZeRO-3's offload: stage {stage} ignores it")
        elif device == "cpu" and stage < least:  # DeepSpeed's stage 1 offloads too; membench's zero1 does not
            reading.not_modelled(f"{SECTION}.{name}_device", f"stage {stage} predicted without offload")
        else:
            reading.used(f"{SECTION}.{name}_device", f"{name}={device}")
    reading.used(f"{SECTION}.gradient_accumulation_steps", f"grad_accumulation:micro_batches={steps}"
                 if steps and steps > 1 else "one micro-batch")
    _mark_precision(reading, precision)
    return zero, [], micro * accumulated


def _from_file(reading: Reading, keys: list[str], processes: int, batch: int, source: str,
               hidden: int | None) -> tuple[list[str], list, int]:
    decided = [key for key in keys if key in FILE_DECIDES]
    if decided:
        raise UsageError(f"accelerate key {SECTION}.{decided[0]}: the deepspeed_config_file decides it and accelerate "
                         f"refuses both; valid: remove {', '.join(decided)} or deepspeed_config_file")
    if reading.get("mixed_precision", None) is not None:
        raise UsageError(f"accelerate key mixed_precision={reading.get('mixed_precision')!r} beside "
                         f"{SECTION}.deepspeed_config_file: accelerate refuses it (the file's bf16/fp16 decide); "
                         "valid: remove mixed_precision")
    reading.used("mixed_precision", "none: the DeepSpeed JSON's bf16/fp16 sections decide")
    key = f"{SECTION}.deepspeed_config_file"
    path = reading.get(key, types=(str,))
    beside = Path(source).parent / path
    found = path if Path(path).expanduser().is_file() or not beside.is_file() else str(beside)
    values = load_deepspeed(found, key=f"accelerate key {key}")
    if not isinstance(values.get("zero_optimization"), dict):
        raise UsageError(f"accelerate key {key}={path}: the file has no zero_optimization section, which accelerate "
                         "requires; valid: a DeepSpeed JSON with one")
    values.setdefault("gradient_accumulation_steps", 1)  # DeepSpeedPlugin.__post_init__ sets it where absent
    zero, micro, accumulated, ranks, uses, assumptions = deepspeed_members(values, _filler(batch, 1, hidden),
                                                                           prefix=FILE_PREFIX)
    if ranks is not None and ranks != processes:
        raise UsageError(f"accelerate: {key}'s train_batch_size gives {ranks} ranks and num_processes is "
                         f"{processes}; DeepSpeed refuses the mismatch; valid: train_batch_size auto")
    reading.used(key, f"{found} (its keys below, as {FILE_PREFIX}*)")
    reading.assume("the DeepSpeed JSON's auto values as accelerate fills them: the micro batch the script's (1 unless "
                   "--batch-size), accumulation 1, bf16/fp16 off (accelerate launch's --mixed_precision)")
    for line in assumptions:
        reading.assume(f"deepspeed: {line}")
    return zero, uses, micro * accumulated


def _filler(batch: int, steps: int, hidden: int | None) -> Trainer:
    """What fills the JSON's "auto" values under accelerate: the script's batch and accumulation; the precision is
    the JSON's own here (the plugin wrote it from mixed_precision), so "auto" there is off."""
    return Trainer(batch, steps, False, False, hidden, filler="the training script's, through accelerate")


def _mixed_precision(reading: Reading) -> str:
    """mixed_precision as accelerate reads it (YAML reads an unquoted `no` as false)."""
    value = reading.get("mixed_precision", "no", types=(str, bool))
    value = "no" if value is False else value
    if value not in ("no", "bf16", "fp16", "fp8"):
        raise UsageError(f"accelerate key mixed_precision: unknown value {value!r}; valid choices: no, bf16, fp16, fp8")
    return value


def _mark_precision(reading: Reading, precision: str) -> None:
    if precision == "fp8":
        reading.not_modelled("mixed_precision", "fp8: DeepSpeed's bf16 section enabled (bf16_weights); the float8 "
                                                "matmuls are not predicted")
    elif precision == "fp16":
        reading.not_modelled("mixed_precision", "fp16: DeepSpeed's fp16 section, predicted as bfloat16 weights (the "
                                                "same bytes; the loss scaler not modelled)")
    else:
        reading.used("mixed_precision", "DeepSpeed's bf16 section: bf16_weights, float32 masters (no autocast)"
                     if precision == "bf16" else "float32 model and masters")
