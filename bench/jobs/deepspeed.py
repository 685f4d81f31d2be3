"""DeepSpeed configuration JSON (`ds_config.json`, as `deepspeed.initialize(config=...)` and the Trainer's `deepspeed`
argument take it) as membench's `zero2`/`zero3` strategy, with every key's fate.

Alone (`predict --config ds_config.json --workload hf:<model>`: a DeepSpeed configuration names no model), or
referenced by a Trainer/TRL configuration's `deepspeed` key (a path, or the mapping itself), whose `"auto"` values
take the Trainer's as transformers' `HfTrainerDeepSpeedConfig.trainer_config_process/finalize` fills them
(integrations/deepspeed.py): `train_micro_batch_size_per_gpu` the per-device batch, `gradient_accumulation_steps`
the Trainer's, `bf16.enabled`/`fp16.enabled` its bf16/fp16, `reduce_bucket_size` hidden_size x hidden_size,
`stage3_prefetch_bucket_size` 0.9 x that, `stage3_param_persistence_threshold` 10 x hidden_size.

What membench makes of each (DeepSpeed 0.19.8's `DeepSpeedZeroConfig`, runtime/zero/config.py, gives the defaults):
- `zero_optimization.stage` 2 or 3: `zero2` / `zero3` (strategies/framework/deepspeed_zero.py); 0 and 1 are not
  modelled (predicted as `ddp` and `zero1`);
- `bf16.enabled`: the model in bfloat16 (`bf16_weights`), float32 masters kept by the stage; `fp16.enabled`: predicted
  as bfloat16 (the same bytes; DeepSpeed's loss scaler is not modelled);
- `reduce_bucket_size`, `overlap_comm`, `contiguous_gradients`, `sub_group_size`, `stage3_prefetch_bucket_size`,
  `stage3_max_live_parameters`, `stage3_max_reuse_distance`, `stage3_param_persistence_threshold`,
  `offload_optimizer.device`,
  `offload_param.device`: the strategy's options of the same names (`nvme` offload is refused: not modelled);
- `train_micro_batch_size_per_gpu` x `gradient_accumulation_steps` the batch per device (`grad_accumulation`),
  `train_batch_size` with both gives the ranks (train_batch_size / (micro x accumulation));
- `activation_checkpointing.*`: the Trainer's `gradient_checkpointing` decides checkpointing, not these;
- the optimizer: DeepSpeed's `optimizer.type` Adam/AdamW (its FusedAdam or, offloaded, DeepSpeedCPUAdam: the same two
  float32 moments as torch's AdamW) is the workload's AdamW; other types are not modelled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.core.errors import UsageError
from bench.jobs.job import IGNORED, NOT_MODELLED, USED, DerivedJob, Key, Reading, spec_of

KIND = "deepspeed"
AUTO = "auto"
_HOST = "logging, checkpointing or launching: does not change a step's memory"
OFFLOAD_DEVICES = ("none", "cpu")
STAGES = (0, 1, 2, 3)
# DeepSpeed keys -> the zero strategies' options (strategies/framework/deepspeed_zero.py), per stage
SIZE_OPTIONS = {"zero_optimization.reduce_bucket_size": "reduce_bucket_size",
                "zero_optimization.sub_group_size": "sub_group_size",
                "zero_optimization.stage3_prefetch_bucket_size": "prefetch_bucket_size",
                "zero_optimization.stage3_max_live_parameters": "max_live_parameters",
                "zero_optimization.stage3_max_reuse_distance": "max_reuse_distance",
                "zero_optimization.stage3_param_persistence_threshold": "param_persistence_threshold"}
STAGE3_ONLY = ("sub_group_size", "prefetch_bucket_size", "max_live_parameters", "max_reuse_distance",
               "param_persistence_threshold", "offload_param")

KEYS = (
    Key("zero_optimization.stage", USED, "zero2 or zero3"),
    Key("zero_optimization.reduce_bucket_size", USED, "the gradient bucket's elements"),
    Key("zero_optimization.overlap_comm", USED, "a second gradient bucket"),
    Key("zero_optimization.contiguous_gradients", USED, "gradients copied into the bucket"),
    Key("zero_optimization.sub_group_size", USED, "zero3:sub_group_size"),
    Key("zero_optimization.stage3_prefetch_bucket_size", USED, "zero3:prefetch_bucket_size"),
    Key("zero_optimization.stage3_max_live_parameters", USED, "zero3:max_live_parameters"),
    Key("zero_optimization.stage3_param_persistence_threshold", USED, "zero3:param_persistence_threshold"),
    Key("zero_optimization.offload_optimizer.device", USED, "offload_optimizer"),
    Key("zero_optimization.offload_param.device", USED, "zero3:offload_param"),
    Key("zero_optimization.offload_optimizer.pin_memory", IGNORED, "pinned or not, the same host bytes"),
    Key("zero_optimization.offload_param.pin_memory", IGNORED, "pinned or not, the same host bytes"),
    Key("zero_optimization.offload_*", NOT_MODELLED, "an offload setting membench does not read (NVMe's buffers)"),
    Key("zero_optimization.allgather_partitions", IGNORED, "all-gather or broadcast: the same buffers"),
    Key("zero_optimization.allgather_bucket_size", NOT_MODELLED, "ZeRO-2's all-gather runs in place over the flat "
                                                                 "buffer: no bucket modelled"),
    Key("zero_optimization.reduce_scatter", IGNORED, "reduce-scatter or all-reduce: the same bucket"),
    Key("zero_optimization.round_robin_gradients", NOT_MODELLED, "the partitions' order: the same sizes assumed"),
    Key("zero_optimization.stage3_max_reuse_distance", USED, "zero3:max_reuse_distance"),
    Key("zero_optimization.stage3_gather_16bit_weights_on_model_save", IGNORED, _HOST),
    Key("zero_optimization.stage3_gather_fp16_weights_on_model_save", IGNORED, _HOST),
    Key("zero_optimization.gather_16bit_weights_on_model_save", IGNORED, _HOST),
    Key("zero_optimization.elastic_checkpoint", IGNORED, _HOST),
    Key("zero_optimization.load_from_fp32_weights", IGNORED, _HOST),
    Key("zero_optimization.ignore_unused_parameters", IGNORED, "every parameter is used by the workloads"),
    Key("zero_optimization.memory_efficient_linear", NOT_MODELLED, "zero3 predicts DeepSpeed's default, true (the "
                                                                   "weight saved as the parameter); false not read"),
    # the rest of DeepSpeedZeroConfig's fields (runtime/zero/config.py), by name: a misspelt key is refused
    *(Key(f"zero_optimization.{name}", NOT_MODELLED, "a ZeRO setting membench does not read: DeepSpeed's default")
      for name in ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory", "model_persistence_threshold",
                   "stage3_module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params",
                   "stage3_allgather_sequential", "use_multi_rank_bucket_allreduce", "compute_grad_norm",
                   "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
                   "zero_quantized_gradients", "pipeline_loading_checkpoint", "override_module_apply",
                   "log_trace_cache_warnings", "enable_sanity_checks", "save_muon_momentum_buffer_in_memory",
                   "leaf_module", "parameter_alignment", "zenflow", "mics_shard_size",
                   "mics_hierarchical_params_gather", "legacy_stage1")),
    Key("bf16.enabled", USED, "bf16_weights (16-bit model, float32 masters)"),
    Key("bf16.*", NOT_MODELLED, "a bf16 setting membench does not read: DeepSpeed's default"),
    Key("fp16.enabled", USED, "16-bit model, float32 masters (the loss scaler not modelled)"),
    Key("fp16.*", IGNORED, "the loss scaler's settings: a scalar"),
    Key("amp.*", NOT_MODELLED, "apex amp: not modelled"),
    Key("train_micro_batch_size_per_gpu", USED, "the batch per device"),
    Key("gradient_accumulation_steps", USED, "grad_accumulation:micro_batches"),
    Key("train_batch_size", USED, "with the two above: the ranks"),
    Key("optimizer.type", USED, "Adam/AdamW: the workload's AdamW"),
    Key("optimizer.params.*", IGNORED, "learning rate, betas, eps, weight decay: the same state"),
    Key("scheduler.*", IGNORED, "the learning-rate schedule: no tensors"),
    Key("gradient_clipping", NOT_MODELLED, "the norm's temporaries: not counted"),
    Key("activation_checkpointing.*", NOT_MODELLED, "DeepSpeed's checkpointing API: the Trainer's "
                                                    "gradient_checkpointing decides (transformers' own)"),
    Key("steps_per_print", IGNORED, _HOST), Key("wall_clock_breakdown", IGNORED, _HOST),
    Key("tensorboard.*", IGNORED, _HOST), Key("wandb.*", IGNORED, _HOST), Key("csv_monitor.*", IGNORED, _HOST),
    Key("comms_logger.*", IGNORED, _HOST), Key("flops_profiler.*", IGNORED, _HOST),
    Key("checkpoint.*", IGNORED, _HOST), Key("dump_state", IGNORED, _HOST), Key("prescale_gradients", IGNORED,
                                                                                "scaling before or after: a scalar"),
    Key("gradient_predivide_factor", IGNORED, "a scalar"), Key("communication_data_type", NOT_MODELLED,
                                                               "the gradients' own dtype assumed"),
    Key("seq_parallel_communication_data_type", NOT_MODELLED, "no sequence parallelism modelled"),
    Key("zero_allow_untested_optimizer", IGNORED, "a check"), Key("zero_force_ds_cpu_optimizer", IGNORED, "a check"),
    Key("data_types.*", NOT_MODELLED, "the gradient accumulation dtype: the parameters' assumed"),
    Key("compile.*", NOT_MODELLED, "DeepSpeed's compile: eager assumed"),
)


def load_deepspeed(value: Any, key: str = "deepspeed") -> dict[str, Any]:
    """A DeepSpeed configuration from a Trainer's `deepspeed` value: a mapping, a JSON string, or a path."""
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError as error:
            raise UsageError(f"{key}: not valid JSON ({error.msg} at line {error.lineno})") from None
    if isinstance(value, (str, Path)):
        path = Path(value).expanduser()
        if not path.is_file():
            raise UsageError(f"{key}: no DeepSpeed configuration file {str(value)!r}; valid: a JSON file's path or "
                             "the mapping itself")
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise UsageError(f"{key}: {value} is not valid JSON ({error.msg} at line {error.lineno})") from None
    raise UsageError(f"{key}: {value!r}; valid: a DeepSpeed configuration JSON file's path or a mapping")


def is_deepspeed(values: dict[str, Any]) -> bool:
    """Whether a configuration mapping is DeepSpeed's own (its ZeRO section or micro-batch key)."""
    return isinstance(values.get("zero_optimization"), dict) or "train_micro_batch_size_per_gpu" in values


class Trainer:
    """What a Trainer's configuration (or accelerate's `Accelerator`: `filler` names which) gives DeepSpeed's "auto"
    values (None where it is read alone)."""

    def __init__(self, micro_batch: int, accumulation: int, bf16: bool, fp16: bool, hidden_size: int | None,
                 filler: str = "the Trainer's"):
        self.micro_batch, self.accumulation = micro_batch, accumulation
        self.bf16, self.fp16, self.hidden_size = bf16, fp16, hidden_size
        self.filler = filler


def _auto(reading: Reading, key: str, trainer: Trainer | None, value: Any, what: str) -> Any:
    if trainer is None:
        raise UsageError(f"{KIND} key {key}: 'auto' is filled by the Trainer; read alone, give a value ({what})")
    return value


def deepspeed_members(values: dict[str, Any], trainer: Trainer | None, prefix: str = "",
                      hidden_size: int | None = None) -> tuple[list[str], int, int, int | None, list, list[str]]:
    """(strategy members, micro batch, accumulation steps, ranks or None, key uses, assumptions) of a DeepSpeed
    configuration; `trainer` fills its "auto" values; `prefix` names its keys in the uses (`deepspeed.`)."""
    reading = Reading(KIND, values, KEYS, nested=("*",))
    stage = reading.get("zero_optimization.stage", 0, types=(int,), choices=STAGES)
    members: list[str] = []
    if stage in (0, 1):
        members.append("ddp" if stage == 0 else "zero1")
        reading.not_modelled("zero_optimization.stage", f"stage {stage}: predicted as membench's "
                                                        f"{'ddp' if stage == 0 else 'zero1'}")
    precision = _precision(reading, trainer)
    hidden = trainer.hidden_size if trainer else hidden_size
    options = _zero_options(reading, stage, hidden) if stage >= 2 else []
    if stage >= 2:
        members.append(":".join([f"zero{stage}", *options]))
        reading.used("zero_optimization.stage", members[-1])
    members += precision
    optimizer = reading.get("optimizer.type", None, types=(str, type(None)))
    if optimizer is not None and optimizer.lower() not in ("adam", "adamw", "fusedadam", "cpuadam"):
        reading.not_modelled("optimizer.type", f"{optimizer}: the workload's AdamW predicted")
    micro = _count(reading, "train_micro_batch_size_per_gpu", trainer.micro_batch if trainer else None, trainer)
    steps = _count(reading, "gradient_accumulation_steps", trainer.accumulation if trainer else 1, trainer)
    if micro is None:
        raise UsageError(f"{KIND} configuration: no train_micro_batch_size_per_gpu; give it (or --batch-size)")
    ranks = None
    total = reading.get("train_batch_size", None, types=(int, str, type(None)))
    if total not in (None, AUTO):
        if not isinstance(total, int) or total < 1 or total % (micro * steps):
            raise UsageError(f"{KIND} key train_batch_size: {total!r}; valid: a multiple of "
                             f"train_micro_batch_size_per_gpu x gradient_accumulation_steps ({micro * steps})")
        ranks = total // (micro * steps)
        reading.used("train_batch_size", f"{ranks} ranks ({total} / {micro} / {steps})")
    else:
        reading.used("train_batch_size", f"auto: {trainer.filler if trainer else 'the launcher'}" if total == AUTO
                     else "not given")
    if steps > 1:
        members.append(f"grad_accumulation:micro_batches={steps}")
    uses = reading.finish()
    if prefix:
        uses = [type(u)(prefix + u.key, u.value, u.fate, u.detail) for u in uses]
    return members, micro, steps, ranks, uses, reading.assumptions


def _count(reading: Reading, key: str, from_trainer: int | None, trainer: Trainer | None) -> int | None:
    value = reading.get(key, from_trainer, types=(int, str, type(None)))
    if value == AUTO:
        value = _auto(reading, key, trainer, from_trainer, "a positive integer")
    if value is not None and (not isinstance(value, int) or value < 1):
        raise UsageError(f"{KIND} key {key}: {value!r}; valid: a positive integer")
    filler = trainer.filler if trainer else ""
    reading.used(key, f"{value}" + (f" (auto: {filler})" if reading.values.get(key) == AUTO else ""))
    return value


def _precision(reading: Reading, trainer: Trainer | None) -> list[str]:
    enabled = {}
    for section in ("bf16", "fp16"):
        value = reading.get(f"{section}.enabled", False, types=(bool, str))
        if value == AUTO:
            value = _auto(reading, f"{section}.enabled", trainer, getattr(trainer, section, False), "true or false")
        elif isinstance(value, str):
            raise UsageError(f"{KIND} key {section}.enabled: {value!r}; valid: true, false or auto")
        enabled[section] = value
    if enabled["bf16"] and enabled["fp16"]:
        raise UsageError(f"{KIND} keys bf16.enabled and fp16.enabled: both true; DeepSpeed refuses it; valid: one")
    reading.used("bf16.enabled", "bf16_weights: the model in bfloat16, float32 masters" if enabled["bf16"] else "off")
    if enabled["fp16"]:
        reading.not_modelled("fp16.enabled", "float16 predicted as bfloat16 (bf16_weights: the same bytes; the loss "
                                             "scaler not modelled)")
    else:
        reading.used("fp16.enabled", "off")
    if not (enabled["bf16"] or enabled["fp16"]):
        reading.assume("no bf16/fp16 section enabled: DeepSpeed trains the float32 model with a float32 master copy")
    return ["bf16_weights"] if enabled["bf16"] or enabled["fp16"] else []


def _zero_options(reading: Reading, stage: int, hidden: int | None) -> list[str]:
    from strategies import STRATEGIES
    from strategies.framework.deepspeed_zero import element_count

    defaults = STRATEGIES.get(f"zero{stage}").options
    auto_sizes = {"reduce_bucket_size": hidden * hidden if hidden else None,
                  "prefetch_bucket_size": int(0.9 * hidden * hidden) if hidden else None,
                  "param_persistence_threshold": 10 * hidden if hidden else None}
    options = []
    for key, option in SIZE_OPTIONS.items():
        if key not in reading:
            continue
        if option not in defaults:
            reading.ignored(key, f"a ZeRO-3 setting: stage {stage} does not read it")
            continue
        value = reading.get(key, types=(int, float, str))
        if value == AUTO:
            value = auto_sizes.get(option)  # transformers' rule, from the model's hidden size
            if value is None:
                reading.not_modelled(key, f"auto: the model's hidden size is not known here; DeepSpeed's default "
                                          f"{defaults[option]} assumed")
                continue
            detail = f"{option}={value} (auto: from the model's hidden size {hidden})"
        elif isinstance(value, str):
            raise UsageError(f"{KIND} key {key}: {value!r}; valid: a number of elements or auto")
        else:
            try:
                value = element_count(value)
            except UsageError:
                raise UsageError(f"{KIND} key {key}: {value!r}; valid: a number of elements, 0 or more") from None
            detail = f"{option}={value}"
        reading.used(key, detail)
        if value != defaults[option]:
            options.append(f"{option}={value}")
    for key, option in (("zero_optimization.overlap_comm", "overlap_comm"),
                        ("zero_optimization.contiguous_gradients", "contiguous_gradients")):
        value = reading.get(key, None, types=(bool, type(None)))
        if value is not None and value != defaults[option]:
            options.append(f"{option}={str(value).lower()}")
        reading.used(key)
    for section, option in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_param")):
        key = f"zero_optimization.{section}.device"
        device = reading.get(key, "none", types=(str, type(None)), choices=("none", "cpu", "nvme", None))
        if device == "nvme":
            raise UsageError(f"{KIND} key {key}: nvme offload is not predicted by membench; valid choices: "
                             f"{', '.join(OFFLOAD_DEVICES)}")
        if device == "cpu" and option not in defaults:
            reading.ignored(key, f"parameter offload is ZeRO-3's: stage {stage} does not read it")
            continue
        if device == "cpu":
            options.append(f"{option}=cpu")
        reading.used(key, f"{option}={device or 'none'}")
    return options


def hidden_size(workload: str) -> int | None:
    """The model's hidden size, for DeepSpeed's "auto" bucket sizes; None where its configuration cannot be read."""
    from workloads.framework.hf_config import resolve_config

    name = workload.removeprefix("hf:").split(":")[0]
    try:
        return int(resolve_config(name).values.get("hidden_size") or 0) or None
    except Exception:  # noqa: BLE001 - an unreadable config leaves "auto" to DeepSpeed's defaults, said per key
        return None


def read_deepspeed(values: dict[str, Any], source: str, overrides: tuple[str, ...] = (),
                   workload: str | None = None) -> DerivedJob:
    """The DerivedJob of a DeepSpeed configuration read alone: its model is `workload` (--workload)."""
    members, micro, steps, ranks, uses, assumptions = deepspeed_members(
        values, None, hidden_size=hidden_size(workload) if workload else None)
    if not workload:
        raise UsageError(f"{KIND} configuration {source}: it names no model; give --workload hf:<model>")
    return DerivedJob(kind=KIND, source=source, overrides=overrides, workload=workload, model=workload,
                      strategy=spec_of(members), batch_size=micro * steps, ranks=ranks, keys=uses,
                      assumptions=assumptions)
