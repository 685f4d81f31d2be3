"""torchtitan's TOML training configurations (`--job.config_file` of its train.py) as a membench case, rank by rank.

What torchtitan (pytorch/torchtitan at TORCHTITAN_COMMIT of bench.jobs.torchtitan_keys, the last commit with TOML
job files: its torchtitan/config/job_config.py gives each key's default, torchtitan/models/llama3/infra/parallelize.py
what the keys do to the model) does with each key, as membench's spec:
- `model.name`/`model.flavor`: the architecture (`llama3` 8B, 70B, 405B: the Llama 3.1 presets, whose shapes are
  torchtitan's flavours'); the `_flex`/`_varlen` flavours differ only in their attention (predicted as SDPA);
- `parallelism.*_degree`: the mesh. `data_parallel_shard_degree` -1 takes the ranks left over, so the world is the
  ranks the job is launched on (`--ranks`; run_train.sh's NGPU, 8, where not given); FSDP2 is applied when the shard
  degree or the context-parallel degree is above 1 (`fsdp`, `fsdp:replicate=R` for HSDP), DDP when only the replicate
  degree is; `tensor_parallel_degree` and `context_parallel_degree` above 1 are membench's `tp:degree=N` and
  `cp:degree=N` (until those strategies are registered the case is refused with a line saying so);
- `training.mixed_precision_param`/`mixed_precision_reduce`: FSDP2's MixedPrecisionPolicy
  (`fsdp:param_dtype=bfloat16:reduce_dtype=float32`), or torch.autocast where neither FSDP nor TP/PP is applied
  (`amp:dtype=bfloat16`); `training.dtype: bfloat16` keeps the weights, gradients and optimizer state in bfloat16
  (`bf16_weights`); `training.enable_cpu_offload`: `fsdp:offload=cpu`;
- `parallelism.fsdp_reshard_after_forward`: `never` is `fsdp:reshard_after_forward=false`;
- `activation_checkpoint.mode`: `full` checkpoints every transformer block (`checkpoint:segments=all`); `selective`
  with `selective_ac_option = "op"` is torchtitan's per-operator policy (`selective_checkpoint:policy=every_other_mm`),
  with a number k every k-th block; `memory_budget` is the compiler's activation budget (`compile:budget=`);
- `compile.enable` with `components`: each transformer block compiled (`model`: `compile:scope=layers`) and the
  loss (`loss=true`);
- `training.local_batch_size` is each data-parallel rank's batch; `training.global_batch_size` above that times the
  data-parallel degree accumulates gradients (`grad_accumulation`); `training.seq_len` the sequence length;
- `optimizer.name`/`implementation` (fused by default), `optimizer.early_step_in_backward`
  (`optimizer_in_backward`);
- `model.converters = ["float8"]` (torchao's float8 training of the linear layers): `float8`, with
  `[quantize.linear.float8]`'s (or the older `[float8]`'s) `recipe_name` (`float8:recipe=`),
  `enable_fsdp_float8_all_gather` where FSDP shards (`float8:fsdp_float8_all_gather=true`) and `filter_fqns`
  (`output` leaves the head out; other names are not modelled); `force_recompute_fp8_weight_in_bwd` is what torchao
  does anyway; `precompute_float8_dynamic_scale_for_fsdp` and `emulate` are not modelled, and
  float8 with tensor parallelism is not applied (said not modelled).

Example (the command prints the derived case and every key's fate):

    python -m bench predict --config llama3_70b.toml --ranks 64 --gpu "H100 80GB"
"""

from __future__ import annotations

from typing import Any

from bench.core.errors import UsageError
from bench.jobs.job import DerivedJob, Reading, hf_workload, registered_spec
from bench.jobs.torchtitan_keys import (AC_MODES, COMPILE_COMPONENTS, FLAVORS, FLOAT8_RECIPES, IMPLEMENTATIONS, KEYS,
                                        KIND, LAUNCHER_DEFAULT_RANKS, MODELS, OPTIMIZERS, OTHER_ATTENTION, RESHARD)


def read_torchtitan(values: dict[str, Any], source: str, overrides: tuple[str, ...] = (),
                    ranks: int | None = None) -> DerivedJob:
    """The DerivedJob of a torchtitan job file (a mapping, overrides applied); `ranks`: the processes it is launched
    on, where the command gives them (else the degrees fix them, or run_train.sh's 8)."""
    reading = Reading(KIND, values, KEYS, nested=("*",))
    preset = _model(reading)
    mesh = _mesh(reading, ranks)
    members = _precision_and_sharding(reading, mesh)
    members += _float8(reading, mesh)
    members += _activation_checkpointing_and_compile(reading, mesh)
    members += _optimizer(reading)
    batch, global_batch = _batch(reading, mesh, members)
    seq_len = reading.get("training.seq_len", 2048, types=(int,))
    divisor = mesh["tp"] * mesh["cp"] * 2  # ParallelDims.seq_len_divisor: sequence parallelism, CP's load balancer
    if seq_len < 1 or seq_len % divisor:
        raise UsageError(f"torchtitan key training.seq_len={seq_len}: must be a positive multiple of tensor_parallel_"
                         f"degree x 2 x context_parallel_degree = {divisor}")
    reading.used("training.seq_len", f"seq_len={seq_len}")
    strategy, unsupported = registered_spec(members)
    job = DerivedJob(kind=KIND, source=source, overrides=overrides, model=_model_name(reading),
                     workload=hf_workload(f"hf:{preset}", seq_len), strategy=strategy, batch_size=batch,
                     ranks=mesh["world"] if mesh["world"] > 1 else None, keys=reading.finish(),
                     assumptions=reading.assumptions, unsupported=unsupported, global_batch_size=global_batch)
    return job


def _model_name(reading: Reading) -> str:
    return f"{reading.get('model.name', 'llama3')} {reading.get('model.flavor', 'debugmodel')}"


def _model(reading: Reading) -> str:
    name = reading.get("model.name", "llama3", types=(str,), choices=MODELS)
    flavor = reading.get("model.flavor", "debugmodel", types=(str,), choices=[*FLAVORS, *OTHER_ATTENTION])
    reading.used("model.name")
    if flavor in OTHER_ATTENTION:
        reading.not_modelled("model.flavor", f"{flavor}: {OTHER_ATTENTION[flavor]}'s weights, its attention "
                                             "(FlexAttention or variable-length, block-causal over documents) "
                                             "predicted as SDPA over whole rows")
        flavor = OTHER_ATTENTION[flavor]
    else:
        reading.used("model.flavor", f"hf:{FLAVORS[flavor]} ({name} {flavor}'s shapes)")
    reading.assume("the model is transformers' Llama of the flavour's shapes (torchtitan's own Llama has the same "
                   "weights; its loss upcasts the logits to float32, as membench's does)")
    return FLAVORS[flavor]


def _float8(reading: Reading, mesh: dict[str, int]) -> list[str]:
    """`float8` with the options of `[quantize.linear.float8]` (or the older `[float8]`), as torchtitan's
    Float8Converter builds torchao's Float8LinearConfig from them, where `model.converters` lists float8."""
    converters = reading.get("model.converters", [], types=(list,))
    unknown = [c for c in converters if c != "float8"]
    if unknown:
        raise UsageError(f"torchtitan key model.converters: {unknown[0]!r} is not a converter this reader knows; "
                         "valid choices: float8")
    section = next((s for s in ("quantize.linear.float8.", "float8.") if any(k.startswith(s) for k in reading.values)),
                   "quantize.linear.float8.")
    keys = [k for k in reading.values if k.startswith(("quantize.linear.float8.", "float8."))]
    if not converters:
        reading.used("model.converters", "none")
        for key in keys:
            reading.ignored(key, "float8 settings without the float8 converter: not applied")
        return []
    if mesh["tp"] > 1:
        reading.not_modelled("model.converters", "float8 with tensor parallelism (torchao's float8 TP plans) is not "
                                                 "composed: the linear layers predicted in the job's other dtypes")
        for key in keys:
            reading.not_modelled(key, "float8 not applied (tensor parallelism)")
        return []
    options = []
    recipe = reading.get(section + "recipe_name", None, types=(str, type(None)), choices=(*FLOAT8_RECIPES, None))
    all_gather = reading.get(section + "enable_fsdp_float8_all_gather", False, types=(bool,))
    recompute = reading.get(section + "force_recompute_fp8_weight_in_bwd", False, types=(bool,))
    if recipe is not None and (all_gather or recompute):
        raise UsageError(f"torchtitan key {section}recipe_name={recipe}: torchtitan refuses it together with "
                         "enable_fsdp_float8_all_gather or force_recompute_fp8_weight_in_bwd; valid: one or the other")
    if recipe not in (None, "tensorwise"):
        options.append(f"recipe={recipe}")
    reading.used(section + "recipe_name", f"float8:recipe={recipe}")
    fsdp_enabled = mesh["shard"] > 1 or mesh["cp"] > 1
    if all_gather and fsdp_enabled:
        options.append("fsdp_float8_all_gather=true")
        reading.used(section + "enable_fsdp_float8_all_gather", "float8:fsdp_float8_all_gather=true")
    else:
        reading.ignored(section + "enable_fsdp_float8_all_gather",
                        "FSDP not applied (torchtitan's dp_shard_enabled is false)" if all_gather else "false")
    reading.used(section + "force_recompute_fp8_weight_in_bwd", "the float8 weight cast again in backward whatever "
                                                                "its value (torchao's float8 since the option's "
                                                                "deprecation)")
    filtered = reading.get(section + "filter_fqns", [], types=(list,))
    if "output" in filtered:
        reading.used(section + "filter_fqns", "output: the output head left out (float8's default)")
    else:
        options.append("head=true")
        reading.used(section + "filter_fqns", "float8:head=true (the output head converted too)")
    others = [name for name in filtered if name != "output"]
    if others:
        reading.not_modelled(section + "filter_fqns", f"{', '.join(map(str, others))}: membench leaves out only the "
                                                      "output head; those layers are predicted in float8")
    for key in ("precompute_float8_dynamic_scale_for_fsdp", "emulate"):
        if not reading.get(section + key, False, types=(bool,)):
            reading.ignored(section + key, "false")
    reading.used("model.converters", "float8: torchao's Float8Linear on every Linear whose dimensions are multiples "
                                     "of 16")
    return [":".join(["float8", *options])]


def _degree(reading: Reading, key: str, default: int, allow_auto: bool = False) -> int:
    value = reading.get(key, default, types=(int,))
    if value < 1 and not (allow_auto and value == -1):
        raise UsageError(f"torchtitan key {key}={value}: must be a positive integer"
                         + (" or -1 (the ranks left over)" if allow_auto else ""))
    return value


def _mesh(reading: Reading, ranks: int | None) -> dict[str, int]:
    """The degrees of torchtitan's mesh (ParallelDims) and the world they need."""
    prefix = "parallelism."
    replicate = _degree(reading, prefix + "data_parallel_replicate_degree", 1)
    shard = _degree(reading, prefix + "data_parallel_shard_degree", -1, allow_auto=True)
    tp = _degree(reading, prefix + "tensor_parallel_degree", 1)
    cp = _degree(reading, prefix + "context_parallel_degree", 1)
    pp = _degree(reading, prefix + "pipeline_parallel_degree", 1)
    if pp > 1:
        raise UsageError(f"torchtitan key parallelism.pipeline_parallel_degree={pp}: membench has no pipeline "
                         "parallelism; valid choices: 1")
    reading.used(prefix + "pipeline_parallel_degree", "no pipeline")
    others = replicate * tp * cp
    if shard == -1:
        world = ranks or LAUNCHER_DEFAULT_RANKS
        if ranks is None:
            reading.assume(f"data_parallel_shard_degree -1 (the ranks left over): launched on {world} ranks, "
                           "run_train.sh's NGPU default (give --ranks N for another world)")
        if world % others:
            raise UsageError(f"torchtitan: {world} ranks are not a multiple of data_parallel_replicate_degree x "
                             f"tensor_parallel_degree x context_parallel_degree = {others}; give --ranks a multiple "
                             f"of {others}")
        shard = world // others
    else:
        world = shard * others
        if ranks is not None and ranks != world:
            raise UsageError(f"--ranks {ranks}: the job's degrees make {world} ranks (replicate {replicate} x shard "
                             f"{shard} x tp {tp} x cp {cp}); give --ranks {world} or data_parallel_shard_degree=-1")
    reading.used(prefix + "data_parallel_shard_degree", f"FSDP over {shard} ranks" if shard > 1 else "no sharding")
    reading.used(prefix + "data_parallel_replicate_degree", f"{replicate} replicas" if replicate > 1
                 else "no replication")
    reading.used(prefix + "tensor_parallel_degree", f"tp:degree={tp}" if tp > 1 else "no tensor parallelism")
    reading.used(prefix + "context_parallel_degree", f"cp:degree={cp}" if cp > 1 else "no context parallelism")
    if tp == 1:
        for key in ("disable_loss_parallel", "enable_async_tensor_parallel"):
            reading.ignored(prefix + key, "tensor parallelism is off (degree 1)")
    if cp == 1:
        for key in ("context_parallel_load_balancer", "context_parallel_rotate_method"):
            reading.ignored(prefix + key, "context parallelism is off (degree 1)")
    return {"world": world, "replicate": replicate, "shard": shard, "tp": tp, "cp": cp}


def _precision_and_sharding(reading: Reading, mesh: dict[str, int]) -> list[str]:
    """bf16_weights, then FSDP2 with its mixed precision and offload (or DDP, or autocast), then tp and cp: what
    parallelize_llama applies, by ParallelDims' fsdp_enabled (shard or cp above 1)."""
    members = []
    dtype = reading.get("training.dtype", "float32", types=(str,), choices=("float32", "bfloat16"))
    if dtype == "bfloat16":
        members.append("bf16_weights")
    reading.used("training.dtype", "bf16_weights" if dtype == "bfloat16" else "float32 weights")
    param = reading.get("training.mixed_precision_param", "bfloat16", types=(str,), choices=("bfloat16", "float32"))
    reduce = reading.get("training.mixed_precision_reduce", "float32", types=(str,), choices=("float32",))
    offload = reading.get("training.enable_cpu_offload", False, types=(bool,))
    reshard = reading.get("parallelism.fsdp_reshard_after_forward", "default", types=(str,), choices=RESHARD)
    fsdp_enabled = mesh["shard"] > 1 or mesh["cp"] > 1
    if fsdp_enabled:
        options = [f"param_dtype={param}", f"reduce_dtype={reduce}"]
        options += [f"replicate={mesh['replicate']}"] if mesh["replicate"] > 1 else []
        options += ["offload=cpu"] if offload else []
        options += ["reshard_after_forward=false"] if reshard == "never" else []
        members.append(":".join(["fsdp", *options]))
        reading.used("training.mixed_precision_param", f"fsdp:param_dtype={param}")
        reading.used("training.mixed_precision_reduce", f"fsdp:reduce_dtype={reduce}")
        reading.used("training.enable_cpu_offload", "fsdp:offload=cpu" if offload else "off")
        reading.used("parallelism.fsdp_reshard_after_forward", "fsdp:reshard_after_forward=false" if reshard == "never"
                     else "resharded after forward (no pipeline)")
        reading.assume("FSDP units as membench wraps the Hugging Face model: each decoder layer and the root (with "
                       "the embedding, the final norm and the output head); torchtitan shards the embedding on its "
                       "own and the norm with the head, which it keeps unsharded from forward to backward unless "
                       "fsdp_reshard_after_forward is always")
    else:
        if offload:
            raise UsageError("torchtitan key training.enable_cpu_offload=true: FSDP's offload needs FSDP "
                             "(data_parallel_shard_degree or context_parallel_degree above 1); valid: false")
        for key in ("training.mixed_precision_reduce", "training.enable_cpu_offload",
                    "parallelism.fsdp_reshard_after_forward"):
            reading.ignored(key, "FSDP is not applied (shard and context-parallel degrees 1)")
        if mesh["tp"] > 1:
            reading.ignored("training.mixed_precision_param", "with TP and no FSDP torchtitan trains without mixed "
                                                              "precision (maybe_enable_amp)")
        elif param == "bfloat16" and dtype == "float32":
            members.append("amp:dtype=bfloat16")
            reading.used("training.mixed_precision_param", "amp:dtype=bfloat16 (torch.autocast, no FSDP)")
        else:
            reading.used("training.mixed_precision_param", "no autocast")
        if mesh["replicate"] > 1:
            members.append("ddp")
    if mesh["tp"] > 1:
        member = f"tp:degree={mesh['tp']}"
        if reading.get("parallelism.disable_loss_parallel", False, types=(bool,)):
            if _has_option("tp", "loss_parallel"):
                member += ":loss_parallel=false"
                reading.used("parallelism.disable_loss_parallel", "tp:loss_parallel=false (the logits gathered)")
            else:
                reading.not_modelled("parallelism.disable_loss_parallel")
        else:
            reading.used("parallelism.disable_loss_parallel", "loss parallel (the tp strategy's default)")
        members.append(member)
        reading.not_modelled("parallelism.enable_async_tensor_parallel")
    if mesh["cp"] > 1:
        members.append(f"cp:degree={mesh['cp']}")
        reading.not_modelled("parallelism.context_parallel_load_balancer")
        reading.not_modelled("parallelism.context_parallel_rotate_method")
    return members


def _activation_checkpointing_and_compile(reading: Reading, mesh: dict[str, int]) -> list[str]:
    """The checkpointing and compile members. A job that compiles on a tensor-parallel mesh is predicted without
    torch.compile: membench's compile and tp do not compose (each replaces the step's backward), and each compile
    key is said not modelled (a compiler's memory budget: no checkpointing predicted)."""
    members = []
    mode = reading.get("activation_checkpoint.mode", "selective", types=(str,), choices=AC_MODES)
    option = str(reading.get("activation_checkpoint.selective_ac_option", "2", types=(str, int)))
    compile_asked = reading.get("compile.enable", False, types=(bool,))
    compile_on = compile_asked and mesh["tp"] == 1
    components = reading.get("compile.components", ["model", "loss"], types=(list,))
    unknown = [c for c in components if c not in COMPILE_COMPONENTS]
    if unknown:
        raise UsageError(f"torchtitan key compile.components: unknown component {unknown[0]!r}; valid choices: "
                         f"{', '.join(COMPILE_COMPONENTS)}")
    budget = reading.get("activation_checkpoint.memory_budget", 0.5, types=(float,))
    if mode == "full":
        members.append("checkpoint:segments=all")
        reading.used("activation_checkpoint.mode", "checkpoint:segments=all (every transformer block)")
        reading.ignored("activation_checkpoint.selective_ac_option", "mode full: every block whole")
    elif mode == "selective":
        if option == "op":
            members.append("selective_checkpoint:policy=every_other_mm")
            reading.used("activation_checkpoint.mode", "selective_checkpoint (each transformer block)")
            reading.used("activation_checkpoint.selective_ac_option", "op: save attention's and every other mm's "
                                                                      "output, recompute the rest")
        elif option.isdigit() and int(option) >= 1:
            every = int(option)
            members.append("checkpoint:segments=all")
            reading.used("activation_checkpoint.mode", "checkpoint:segments=all")
            if every == 1:
                reading.used("activation_checkpoint.selective_ac_option", "1: every transformer block")
            else:
                reading.not_modelled("activation_checkpoint.selective_ac_option",
                                     f"{every}: every {every}-th transformer block checkpointed; membench "
                                     "checkpoints every block (checkpoint:segments=all), so the activations of "
                                     "the blocks torchtitan does not checkpoint are under-predicted")
        else:
            raise UsageError(f"torchtitan key activation_checkpoint.selective_ac_option={option!r}: valid choices: "
                             "op, or a positive integer k (every k-th block)")
    elif mode == "memory_budget" and compile_asked and not compile_on:
        reading.not_modelled("activation_checkpoint.mode", "memory_budget: the compiler's budget, not applied "
                                                           "without compile (tensor parallelism): no activation "
                                                           "checkpointing predicted")
        reading.ignored("activation_checkpoint.selective_ac_option", "mode memory_budget: the compiler decides")
    elif mode == "memory_budget":
        if not (compile_on and "model" in components):
            raise UsageError("torchtitan key activation_checkpoint.mode=memory_budget: the budget is the "
                             "compiler's; it needs compile.enable=true with model in compile.components")
        if not 0 < budget <= 1:
            raise UsageError(f"torchtitan key activation_checkpoint.memory_budget={budget}: valid: (0, 1]")
        reading.used("activation_checkpoint.mode", f"compile:budget={budget}")
        reading.ignored("activation_checkpoint.selective_ac_option", "mode memory_budget: the compiler decides")
    else:
        reading.used("activation_checkpoint.mode", "no activation checkpointing")
        reading.ignored("activation_checkpoint.selective_ac_option", "mode none")
    if mode != "memory_budget":
        reading.ignored("activation_checkpoint.memory_budget", f"mode {mode}: no compiler budget")
    elif not compile_on:
        reading.not_modelled("activation_checkpoint.memory_budget", "not applied without compile")
    else:
        reading.used("activation_checkpoint.memory_budget", f"compile:budget={budget}")
    backend = reading.get("compile.backend", "inductor", types=(str,))
    if compile_asked and not compile_on:
        reading.not_modelled("compile.enable", "torch.compile with tensor parallelism is not composed in membench "
                                               "(both replace the backward): predicted without compile, its fusions "
                                               "not applied")
        for key in ("compile.components", "compile.backend"):
            reading.not_modelled(key, "compile not applied (tensor parallelism)")
    elif compile_on and components:
        options = ["scope=layers"] if "model" in components else []
        options += ["loss=true"] if "loss" in components else []
        options += [f"budget={budget}"] if mode == "memory_budget" else []
        options += [f"backend={backend}"] if backend != "inductor" else []
        if "model" not in components:
            reading.not_modelled("compile.components", "loss only: membench compiles the loss with the model's "
                                                       "blocks (compile:scope=layers:loss=true)")
            options.insert(0, "scope=layers")
        else:
            reading.used("compile.components", ", ".join(components))
        members.append(":".join(["compile", *options]))
        reading.used("compile.enable", members[-1])
        reading.used("compile.backend", f"compile:backend={backend}")
    else:
        reading.used("compile.enable", "not compiled")
        reading.ignored("compile.components", "compile is off")
        reading.ignored("compile.backend", "compile is off")
    return members


def _optimizer(reading: Reading) -> list[str]:
    name = reading.get("optimizer.name", "AdamW", types=(str,), choices=OPTIMIZERS)
    implementation = reading.get("optimizer.implementation", "fused", types=(str,), choices=IMPLEMENTATIONS)
    member = f"{OPTIMIZERS[name] or 'optimizer'}:impl={IMPLEMENTATIONS[implementation]}"
    reading.used("optimizer.name", OPTIMIZERS[name] or "torch.optim.AdamW (the workload's)")
    reading.used("optimizer.implementation", f"optimizer:impl={IMPLEMENTATIONS[implementation]}")
    members = [member]
    if reading.get("optimizer.early_step_in_backward", False, types=(bool,)):
        members.append("optimizer_in_backward")
    reading.used("optimizer.early_step_in_backward", "optimizer_in_backward" if len(members) > 1 else "off")
    return members


def _batch(reading: Reading, mesh: dict[str, int], members: list[str]) -> tuple[int, int | None]:
    """(each data-parallel rank's batch of one step: local_batch_size x the accumulated micro-batches, the step's
    batch over every rank where tensor- or context-parallel ranks share their samples, else None)."""
    local = reading.get("training.local_batch_size", 8, types=(int,))
    global_batch = reading.get("training.global_batch_size", -1, types=(int,))
    if local < 1:
        raise UsageError(f"torchtitan key training.local_batch_size={local}: must be a positive integer")
    data_parallel = mesh["replicate"] * mesh["shard"]
    if global_batch == -1:
        steps = 1
    elif global_batch < 1 or global_batch % (local * data_parallel):
        raise UsageError(f"torchtitan key training.global_batch_size={global_batch}: must be -1 or a multiple of "
                         f"local_batch_size x the data-parallel degree ({local} x {data_parallel})")
    else:
        steps = global_batch // (local * data_parallel)
    if steps > 1:
        members.append(f"grad_accumulation:micro_batches={steps}")
    reading.used("training.local_batch_size", f"{local} per data-parallel rank")
    reading.used("training.global_batch_size", f"{steps} accumulated micro-batches" if steps > 1
                 else "no accumulation")
    shared = mesh["tp"] * mesh["cp"] > 1
    return local * steps, local * steps * data_parallel if shared else None


def _has_option(strategy: str, option: str) -> bool:
    """Whether membench's registered `strategy` takes `option` (tp's and cp's options are read at run time)."""
    from strategies import STRATEGIES

    return strategy in STRATEGIES and option in STRATEGIES.get(strategy).options

