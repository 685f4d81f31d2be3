"""accelerate's FSDP and DeepSpeed plugin configuration (the YAML `accelerate config` writes and `accelerate launch
--config_file` reads) as a membench case: the strategy and the ranks; the model, sequence and batch are the training
script's, so they come from `--workload` and `--batch-size`.

What accelerate (1.15, `Accelerator.prepare` and `accelerate.utils.fsdp_utils.fsdp2_prepare_model`) does with each
key, as membench's spec:
- `distributed_type: FSDP` with `fsdp_config.fsdp_version: 2`: FSDP2's `fully_shard` on each decoder layer
  (`fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP`, the model's `_no_split_modules`) and the root (`fsdp`);
  `fsdp_reshard_after_forward: false` keeps each layer's gathered parameters to its backward
  (`fsdp:reshard_after_forward=false`); `fsdp_offload_params: true` is `fsdp:offload=cpu`; version 1's
  `fsdp_sharding_strategy` (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, NO_SHARD) is predicted as FSDP2's equivalent;
- `mixed_precision: bf16` (or fp16): the parameters upcast to float32, the forward under torch.autocast with its
  outputs cast back to float32, and FSDP2's MixedPrecisionPolicy with param, reduce and output dtypes all bfloat16
  (`FullyShardedDataParallelPlugin.set_mixed_precision`): `amp:dtype=bfloat16+fsdp:param_dtype=bfloat16:
  reduce_dtype=bfloat16:output_dtype=bfloat16`;
- `fsdp_activation_checkpointing: true`: each wrapped layer checkpointed (`checkpoint:segments=all`), its saved input
  in host memory with `fsdp_activation_checkpointing_offload` (`offload`);
- `dynamo_config.dynamo_backend` other than NO: the model compiled (`compile`), each layer on its own with
  `dynamo_use_regional_compilation` (`compile:scope=layers`);
- `num_processes`: the ranks (all machines' processes together); `parallelism_config`'s tensor and context degrees
  are membench's `tp:degree=N`, `cp:degree=N` (refused with a line while those strategies are not registered).
- `distributed_type: DEEPSPEED`: accelerate's DeepSpeed plugin, its `deepspeed_config:` section read into `zero2`/
  `zero3` as bench/jobs/accelerate_deepspeed.py says.
"""

from __future__ import annotations

from typing import Any

from bench.core.errors import UsageError
from bench.jobs import accelerate_deepspeed
from bench.jobs.job import IGNORED, NOT_MODELLED, USED, DerivedJob, Key, Reading, registered_spec, workload_options

KIND = "accelerate"
DISTRIBUTED_TYPES = ("FSDP", "DEEPSPEED", "NO", "MULTI_GPU")
MIXED_PRECISION = {"no": None, "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}
# FSDP1's sharding strategies (names or ShardingStrategy's numbers) -> the FSDP2 options that shard the same way
SHARDING_STRATEGIES = {"FULL_SHARD": "", "SHARD_GRAD_OP": "reshard_after_forward=false", "NO_SHARD": None,
                       "HYBRID_SHARD": "replicate", "HYBRID_SHARD_ZERO2": "replicate"}
SHARDING_NUMBERS = {1: "FULL_SHARD", 2: "SHARD_GRAD_OP", 3: "NO_SHARD", 4: "HYBRID_SHARD", 5: "HYBRID_SHARD_ZERO2"}
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
ASSUMED_BATCH = 1
_HOST = "launching, loading or saving: does not change a step's GPU memory"

KEYS = (
    Key("distributed_type", USED, "FSDP: fsdp; DEEPSPEED: zero2/zero3; NO, MULTI_GPU: one device or ddp"),
    Key("mixed_precision", USED, "bf16/fp16: amp plus FSDP2's param, reduce and output dtypes"),
    Key("num_processes", USED, "the ranks (every machine's processes)"),
    Key("num_machines", USED, "HYBRID_SHARD's replica groups (FSDP1); otherwise launching only"),
    Key("use_cpu", USED, "false: the GPU membench predicts; true refused"),
    Key("downcast_bf16", IGNORED, "TPUs only"),
    Key("fsdp_config.fsdp_version", USED, "2: FSDP2 as membench runs it; 1: predicted as FSDP2"),
    Key("fsdp_config.fsdp_reshard_after_forward", USED, "false (or SHARD_GRAD_OP): fsdp:reshard_after_forward=false"),
    Key("fsdp_config.fsdp_sharding_strategy", USED, "FSDP1's: FULL_SHARD fsdp, SHARD_GRAD_OP, HYBRID_SHARD "
                                                   "fsdp:replicate, NO_SHARD ddp"),
    Key("fsdp_config.fsdp_offload_params", USED, "fsdp:offload=cpu"),
    Key("fsdp_config.fsdp_activation_checkpointing", USED, "checkpoint:segments=all"),
    Key("fsdp_config.fsdp_activation_checkpointing_offload", USED, "offload (the checkpoints' inputs on the host)"),
    Key("fsdp_config.fsdp_auto_wrap_policy", USED, "TRANSFORMER_BASED_WRAP: each decoder layer a unit"),
    Key("fsdp_config.fsdp_transformer_layer_cls_to_wrap", USED, "the decoder layer (membench's units)"),
    Key("fsdp_config.fsdp_min_num_params", NOT_MODELLED, "SIZE_BASED_WRAP's units: predicted as one per layer"),
    Key("fsdp_config.fsdp_backward_prefetch", NOT_MODELLED, "FSDP1's prefetch: FSDP2 prefetches one unit"),
    Key("fsdp_config.fsdp_forward_prefetch", NOT_MODELLED, "FSDP1's explicit forward prefetch: not predicted"),
    Key("fsdp_config.fsdp_use_orig_params", IGNORED, "FSDP1's parameter views: the same bytes"),
    Key("fsdp_config.fsdp_state_dict_type", IGNORED, "how checkpoints are saved: " + _HOST),
    Key("fsdp_config.fsdp_cpu_ram_efficient_loading", IGNORED, "how weights are loaded: " + _HOST),
    Key("fsdp_config.fsdp_sync_module_states", IGNORED, "weights broadcast at start: " + _HOST),
    Key("fsdp_config.*", NOT_MODELLED, "an FSDP plugin setting membench does not read: its default assumed"),
    Key("dynamo_config.dynamo_backend", USED, "compile (NO: not compiled)"),
    Key("dynamo_config.dynamo_use_regional_compilation", USED, "compile:scope=layers"),
    Key("dynamo_config.dynamo_mode", NOT_MODELLED, "inductor's mode (CUDA graphs with reduce-overhead): not "
                                                   "predicted"),
    Key("dynamo_config.*", IGNORED, "fullgraph and dynamic shapes: the same graphs for fixed shapes"),
    Key("parallelism_config.parallelism_config_tp_size", USED, "tp:degree=N"),
    Key("parallelism_config.parallelism_config_cp_size", USED, "cp:degree=N"),
    Key("parallelism_config.parallelism_config_dp_replicate_size", USED, "fsdp:replicate"),
    Key("parallelism_config.parallelism_config_dp_shard_size", USED, "the FSDP degree (the rest of the ranks)"),
    Key("parallelism_config.*", NOT_MODELLED, "a parallelism setting membench does not read (sequence "
                                              "parallelism's Ulysses backend, CP's exchange): not predicted"),
    Key("compute_environment", IGNORED, _HOST), Key("machine_rank", IGNORED, _HOST),
    Key("main_training_function", IGNORED, _HOST), Key("main_process_ip", IGNORED, _HOST),
    Key("main_process_port", IGNORED, _HOST), Key("rdzv_backend", IGNORED, _HOST),
    Key("same_network", IGNORED, _HOST), Key("gpu_ids", IGNORED, _HOST), Key("enable_cpu_affinity", IGNORED, _HOST),
    Key("debug", IGNORED, "collective checks of the launcher: host side"),
    Key("tpu_*", IGNORED, "TPUs only"), Key("commands", IGNORED, _HOST), Key("command_file", IGNORED, _HOST),
    Key("fp8_config.*", NOT_MODELLED, "float8 training: not predicted"),
    Key("mpirun_config.*", IGNORED, _HOST),
    Key("megatron_lm_config.*", IGNORED, "Megatron-LM's plugin: read only with distributed_type MEGATRON_LM"),
    *accelerate_deepspeed.KEYS,
)
# the sections `accelerate config` writes whatever the distributed type (ClusterConfig.to_dict), empty where unused
SECTIONS = ("fsdp_config", "deepspeed_config", "dynamo_config", "parallelism_config", "fp8_config", "mpirun_config",
            "megatron_lm_config")


def read_accelerate(values: dict[str, Any], source: str, overrides: tuple[str, ...] = (),
                    workload: str | None = None) -> DerivedJob:
    """The DerivedJob of an accelerate config YAML (a mapping, overrides applied) for `workload` (the training
    script's model: `--workload hf:<model>:seq_len=N`)."""
    reading = Reading(KIND, values, KEYS, nested=SECTIONS)
    distributed = reading.get("distributed_type", "NO", types=(str,), choices=DISTRIBUTED_TYPES)
    for section in SECTIONS:
        if section in reading and reading.values[section] in ({}, None):
            reading.ignored(section, "empty")
    if reading.get("use_cpu", False, types=(bool,)):
        raise UsageError("accelerate key use_cpu=true: membench predicts a GPU's memory here; valid: false")
    reading.used("use_cpu", "the GPU")
    if not workload:
        raise UsageError("accelerate's config names no model, sequence or batch (the training script's): give "
                         "--workload hf:<model>:seq_len=N (and --batch-size, each process's batch)")
    processes = reading.get("num_processes", 1, types=(int,))
    machines = reading.get("num_machines", 1, types=(int,))
    if processes == -1:
        reading.assume("num_processes -1 (the launcher's count): one process per --ranks")
        processes = 1
    if processes < 1 or machines < 1:
        raise UsageError(f"accelerate keys num_processes={processes}, num_machines={machines}: each must be a "
                         "positive integer")
    reading.used("num_processes", f"{processes} ranks")
    deepspeed_uses: list = []
    batch = ASSUMED_BATCH  # DeepSpeed's: its micro-batch x its gradient_accumulation_steps
    if distributed == "DEEPSPEED":
        members, deepspeed_uses, batch = _deepspeed(reading, processes, source, workload)
    else:
        for key in [k for k in reading.values if k.startswith("deepspeed_config.")]:
            reading.ignored(key, f"distributed_type {distributed}: DeepSpeed is not used")
        members = _precision(reading, distributed)
        members += _sharding(reading, distributed, processes, machines)
    members += _checkpointing_and_compile(reading, fsdp=distributed == "FSDP")
    reading.assume(f"the training script's batch: {ASSUMED_BATCH} per process unless --batch-size says")
    reading.assume("the training script's optimizer: the workload's AdamW (PyTorch's implementation)")
    strategy, unsupported = registered_spec(members)
    base, options = workload_options(workload if workload.startswith("hf:") else f"hf:{workload}")
    return DerivedJob(kind=KIND, source=source, overrides=overrides, model=base,
                      workload=":".join([base, *(f"{k}={v}" for k, v in options.items())]), strategy=strategy,
                      batch_size=batch, ranks=processes if processes > 1 else None,
                      keys=reading.finish() + deepspeed_uses, assumptions=reading.assumptions,
                      unsupported=unsupported)


def _deepspeed(reading: Reading, processes: int, source: str, workload: str) -> tuple[list[str], list, int]:
    """accelerate's DeepSpeed plugin (bench/jobs/accelerate_deepspeed.py); FSDP's and the parallelism sections'
    keys do not apply under it."""
    members, uses, batch = accelerate_deepspeed.deepspeed_plugin_members(reading, processes, ASSUMED_BATCH, source,
                                                                         workload)
    reading.used("distributed_type", "DeepSpeed: " + "+".join(members))
    reading.ignored("num_machines", "launching: the ranks are num_processes")
    for key in [k for k in reading.values if k.startswith("fsdp_config.")]:
        reading.ignored(key, "distributed_type DEEPSPEED: FSDP is not applied")
    prefix = "parallelism_config.parallelism_config_"
    for key in [k for k in reading.values if k.startswith(prefix)]:
        size = reading.get(key, 1, types=(int,))
        if size != 1 and not key.endswith("dp_shard_size"):
            raise UsageError(f"accelerate key {key}={size} with distributed_type DEEPSPEED: DeepSpeed's tensor and "
                             "sequence parallelism are not predicted by membench; valid: 1")
        reading.used(key, "1: ZeRO over every rank" if size == 1 else "ZeRO over every rank")
    return members, uses, batch



def _precision(reading: Reading, distributed: str) -> list[str]:
    precision = _mixed_precision(reading)
    dtype = MIXED_PRECISION[precision]
    if dtype is None:
        reading.used("mixed_precision", "float32 throughout")
        return []
    if precision == "fp8":
        reading.not_modelled("mixed_precision", "fp8: float8 matmuls (Transformer Engine, torchao or MS-AMP) not "
                                                "predicted; bfloat16 autocast, accelerate's base for fp8, predicted")
    else:
        reading.used("mixed_precision", f"amp:dtype={dtype}" + (f" and FSDP2's param, reduce and output dtypes "
                                                                f"{dtype}" if distributed == "FSDP" else ""))
    return [f"amp:dtype={dtype}"]


def _sharding(reading: Reading, distributed: str, processes: int, machines: int) -> list[str]:
    """fsdp (with its options), ddp or nothing; tp and cp from parallelism_config."""
    prefix = "parallelism_config.parallelism_config_"
    tp = reading.get(prefix + "tp_size", 1, types=(int,))
    cp = reading.get(prefix + "cp_size", 1, types=(int,))
    replicate = reading.get(prefix + "dp_replicate_size", 1, types=(int,))
    for name, size in (("tp_size", tp), ("cp_size", cp), ("dp_replicate_size", replicate)):
        if size < 1:
            raise UsageError(f"accelerate key {prefix}{name}={size}: must be a positive integer")
        reading.used(prefix + name, f"{name.split('_size')[0]} degree {size}")
    reading.used(prefix + "dp_shard_size", "the FSDP degree")
    if processes % (tp * cp * replicate):
        raise UsageError(f"accelerate: num_processes={processes} is not a multiple of tp x cp x dp_replicate = "
                         f"{tp * cp * replicate}")
    members = []
    if distributed != "FSDP":
        if processes > 1:
            members.append("ddp")
        reading.used("distributed_type", "ddp" if members else "one device")
        for key in [k for k in reading.values if k.startswith("fsdp_config.")]:
            reading.ignored(key, f"distributed_type {distributed}: FSDP is not applied")
        return members + _parallel_members(tp, cp)
    options = _mixed_precision_options(reading)
    version = reading.get("fsdp_config.fsdp_version", 1, types=(int,), choices=(1, 2))
    if version == 2:
        reading.used("fsdp_config.fsdp_version", "FSDP2 (fully_shard)")
        reshard = reading.get("fsdp_config.fsdp_reshard_after_forward", True, types=(bool,))
        options += [] if reshard else ["reshard_after_forward=false"]
        reading.used("fsdp_config.fsdp_reshard_after_forward", "fsdp:reshard_after_forward=false" if not reshard
                     else "resharded after forward")
        if "fsdp_config.fsdp_sharding_strategy" in reading:
            raise UsageError("accelerate key fsdp_config.fsdp_sharding_strategy: FSDP1's; with fsdp_version 2 give "
                             "fsdp_reshard_after_forward: true or false")
    else:
        strategy = _fsdp1_strategy(reading)
        option = SHARDING_STRATEGIES[strategy]
        reading.not_modelled("fsdp_config.fsdp_version", "FSDP1 (FlatParameter) predicted as FSDP2 sharding the "
                                                         "same way (per-parameter shards, no flat buffers)")
        if option is None:
            reading.used("distributed_type", "ddp (FSDP1's NO_SHARD replicates like DDP)")
            return ["ddp", *_parallel_members(tp, cp)]
        if option == "replicate":
            if machines < 2:
                raise UsageError(f"accelerate key fsdp_config.fsdp_sharding_strategy={strategy}: shards within a "
                                 "machine and replicates across machines; needs num_machines above 1")
            replicate = machines
            options += ["reshard_after_forward=false"] if strategy.endswith("ZERO2") else []
            reading.used("num_machines", f"fsdp:replicate={machines} (one replica per machine)")
        elif option:
            options.append(option)
    reading.ignored("num_machines", "launching: the ranks are num_processes")
    if replicate > 1:
        options.append(f"replicate={replicate}")
    if reading.get("fsdp_config.fsdp_offload_params", False, types=(bool,)):
        options.append("offload=cpu")
    reading.used("fsdp_config.fsdp_offload_params", "fsdp:offload=cpu" if "offload=cpu" in options else "off")
    policy = reading.get("fsdp_config.fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", types=(str,),
                         choices=WRAP_POLICIES)
    if policy == "TRANSFORMER_BASED_WRAP":
        reading.used("fsdp_config.fsdp_auto_wrap_policy", "each decoder layer its own unit, and the root")
    else:
        reading.not_modelled("fsdp_config.fsdp_auto_wrap_policy", f"{policy}: other units than the decoder layers; "
                                                                  "predicted with each decoder layer a unit")
    reading.used("fsdp_config.fsdp_transformer_layer_cls_to_wrap", "the decoder layer (membench's units)")
    member = ":".join(["fsdp", *options])
    reading.used("distributed_type", member)
    return [member, *_parallel_members(tp, cp)]


def _mixed_precision_options(reading: Reading) -> list[str]:
    """FSDP's MixedPrecisionPolicy as accelerate sets it: param, reduce and output dtypes all the mixed precision's."""
    dtype = MIXED_PRECISION[_mixed_precision(reading)]
    return [] if dtype is None else [f"param_dtype={dtype}", f"reduce_dtype={dtype}", f"output_dtype={dtype}"]


def _mixed_precision(reading: Reading) -> str:
    """mixed_precision as accelerate reads it: YAML reads an unquoted `no` as false."""
    value = reading.get("mixed_precision", "no", types=(str, bool))
    value = "no" if value is False else value
    if value not in MIXED_PRECISION:
        raise UsageError(f"accelerate key mixed_precision: unknown value {value!r}; valid choices: "
                         f"{', '.join(MIXED_PRECISION)}")
    return value


def _fsdp1_strategy(reading: Reading) -> str:
    """FSDP1's sharding strategy: fsdp_sharding_strategy, else fsdp_reshard_after_forward (accelerate reads a
    strategy name there for version 1), FULL_SHARD by default."""
    key = "fsdp_config.fsdp_sharding_strategy"
    value = reading.get(key, None, types=(str, int, type(None)))
    if value is None:
        key = "fsdp_config.fsdp_reshard_after_forward"
        value = reading.get(key, "FULL_SHARD", types=(str, int, bool))
        value = {True: "FULL_SHARD", False: "SHARD_GRAD_OP"}.get(value, value) if isinstance(value, bool) else value
    name = SHARDING_NUMBERS.get(int(value), "") if str(value).isdigit() else str(value).upper()
    if name not in SHARDING_STRATEGIES:
        raise UsageError(f"accelerate key {key}={value!r}: valid choices: {', '.join(SHARDING_STRATEGIES)}")
    reading.used(key, f"FSDP1's {name}")
    return name


def _parallel_members(tp: int, cp: int) -> list[str]:
    return ([f"tp:degree={tp}"] if tp > 1 else []) + ([f"cp:degree={cp}"] if cp > 1 else [])


def _checkpointing_and_compile(reading: Reading, fsdp: bool) -> list[str]:
    """The FSDP plugin's activation checkpointing (where FSDP is applied) and dynamo's compile."""
    members = []
    if fsdp and reading.get("fsdp_config.fsdp_activation_checkpointing", False, types=(bool,)):
        members.append("checkpoint:segments=all")
        if reading.get("fsdp_config.fsdp_activation_checkpointing_offload", False, types=(bool,)):
            members.append("offload")
    if fsdp:
        reading.used("fsdp_config.fsdp_activation_checkpointing", "checkpoint:segments=all" if members else "off")
        reading.used("fsdp_config.fsdp_activation_checkpointing_offload", "offload" if "offload" in members
                     else "off")
    backend = reading.get("dynamo_config.dynamo_backend", "NO", types=(str,))
    regional = reading.get("dynamo_config.dynamo_use_regional_compilation", False, types=(bool,))
    if backend.upper() != "NO":
        if backend.upper() != "INDUCTOR":
            raise UsageError(f"accelerate key dynamo_config.dynamo_backend={backend!r}: membench predicts "
                             "inductor's compiled step; valid choices: INDUCTOR, NO")
        members.append("compile:scope=layers" if regional else "compile")
    reading.used("dynamo_config.dynamo_backend", members[-1] if backend.upper() != "NO" else "not compiled")
    reading.used("dynamo_config.dynamo_use_regional_compilation", "compile:scope=layers" if regional else "off")
    return members
