"""torchtitan's job-file keys, as data: what each does to a training step's memory (the spec member it becomes, or why
it is ignored or not modelled), the choices of its enumerated keys and the flavours' presets, at TORCHTITAN_COMMIT
(bench.jobs.torchtitan reads a file with them)."""

from __future__ import annotations

from bench.jobs.job import IGNORED, NOT_MODELLED, USED, Key

KIND = "torchtitan"
TORCHTITAN_COMMIT = "238fa9953e4aec2a62582121564273d7cbb1e9f1"  # 2026-02-23, the parent of the move to Python configs
# run_train.sh's NGPU default: the processes torchtitan's launcher starts where the job names no degree that fixes them
LAUNCHER_DEFAULT_RANKS = 8
# (model.name, model.flavor) -> the membench preset of that architecture: torchtitan's llama3 flavours
# (torchtitan/models/llama3/__init__.py) have the Llama 3.1 checkpoints' shapes (dim, layers, heads, kv heads, the
# feed-forward width from ffn_dim_multiplier and multiple_of, rope_theta 500000; the 128,256-token vocabulary)
FLAVORS = {"8B": "llama-3.1-8b", "70B": "llama-3.1-70b", "405B": "llama-3.1-405b"}
# flavours whose weights are another's, with FlexAttention or variable-length attention over packed documents
OTHER_ATTENTION = {"8B_flex": "8B", "8B_varlen": "8B"}
MODELS = ("llama3",)
OPTIMIZERS = {"AdamW": "", "Adam": "optimizer:name=adam"}
IMPLEMENTATIONS = {"fused": "fused", "foreach": "foreach", "for-loop": "for_loop"}
AC_MODES = ("none", "full", "selective", "memory_budget")
RESHARD = ("default", "always", "never")
COMPILE_COMPONENTS = ("model", "loss")
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's Float8LinearConfig.from_recipe_name
# [quantize.linear.float8] (and the older [float8] section, which also had force_recompute_fp8_weight_in_bwd)
_FLOAT8_KEYS = (
    ("recipe_name", USED, "float8:recipe (tensorwise by default)"),
    ("enable_fsdp_float8_all_gather", USED, "float8:fsdp_float8_all_gather=true where FSDP shards"),
    ("force_recompute_fp8_weight_in_bwd", USED, "the float8 weight cast again in backward: torchao's float8 does"),
    ("filter_fqns", USED, "output: the head left out (float8's default); empty: float8:head=true; other names not "
                          "modelled"),
    ("precompute_float8_dynamic_scale_for_fsdp", NOT_MODELLED, "one scale computation for every weight after the "
                                                               "step: each weight's scale computed as it is cast"),
    ("emulate", NOT_MODELLED, "float8 emulated in high precision (tests without sm_89): float8's kernels predicted"),
)
_HOST = "host side (logging, saving, loading, launching): not a step's GPU memory"
_VALUES = "a hyperparameter: values, not memory"

KEYS = (
    Key("model.name", USED, "the model family (llama3)"),
    Key("model.flavor", USED, "the architecture: a Llama 3.1 preset"),
    Key("model.converters", USED, "float8: torchao's float8 linear layers (float8); none: nothing"),
    Key("model.hf_assets_path", IGNORED, "the tokenizer's and weights' files: " + _HOST),
    Key("model.tokenizer_path", IGNORED, "the tokenizer's files: " + _HOST),
    Key("model.print_after_conversion", IGNORED, _HOST),
    Key("training.local_batch_size", USED, "each data-parallel rank's batch"),
    Key("training.global_batch_size", USED, "above local_batch_size x the data-parallel degree: "
                                            "grad_accumulation:micro_batches"),
    Key("training.seq_len", USED, "the workload's seq_len"),
    Key("training.dtype", USED, "bfloat16: bf16_weights; float32: float32 weights"),
    Key("training.mixed_precision_param", USED, "fsdp:param_dtype (or amp:dtype without FSDP, TP or PP)"),
    Key("training.mixed_precision_reduce", USED, "fsdp:reduce_dtype"),
    Key("training.enable_cpu_offload", USED, "fsdp:offload=cpu"),
    Key("training.max_norm", NOT_MODELLED, "gradient clipping's norm: small temporaries, not counted"),
    Key("training.dataset", IGNORED, "which data set: rows are seq_len tokens whatever it is"),
    Key("training.dataset_path", IGNORED, "where the data set is read from: " + _HOST),
    Key("training.steps", IGNORED, "how long training lasts: each step is the same"),
    Key("training.gc_freq", IGNORED, "Python's garbage collection between steps: host memory"),
    Key("training.gc_debug", IGNORED, "Python's garbage collection between steps: host memory"),
    Key("training.dataloader.*", IGNORED, "the data loader's workers and pinning: host memory"),
    Key("parallelism.data_parallel_replicate_degree", USED, "fsdp:replicate (HSDP), or ddp alone"),
    Key("parallelism.data_parallel_shard_degree", USED, "the FSDP degree (-1: the ranks left over)"),
    Key("parallelism.fsdp_reshard_after_forward", USED, "never: fsdp:reshard_after_forward=false"),
    Key("parallelism.tensor_parallel_degree", USED, "tp:degree=N (tensor and sequence parallelism)"),
    Key("parallelism.context_parallel_degree", USED, "cp:degree=N (context parallelism)"),
    Key("parallelism.pipeline_parallel_degree", USED, "1: no pipeline (membench has no pipeline parallelism)"),
    Key("parallelism.disable_loss_parallel", USED, "true: tp:loss_parallel=false (the logits gathered before the "
                                                   "loss); false: the loss on the vocabulary shards"),
    Key("parallelism.enable_async_tensor_parallel", NOT_MODELLED, "asynchronous TP's symmetric-memory buffers: "
                                                                  "not predicted"),
    Key("parallelism.context_parallel_load_balancer", NOT_MODELLED, "how the sequence is split among the CP "
                                                                    "ranks: equal shares predicted"),
    Key("parallelism.context_parallel_rotate_method", NOT_MODELLED, "how CP exchanges keys and values: the cp "
                                                                    "strategy's own predicted"),
    Key("parallelism.pipeline_parallel_*", IGNORED, "pipeline settings: no pipeline (degree 1)"),
    Key("parallelism.module_fqns_per_model_part", IGNORED, "pipeline stages: no pipeline (degree 1)"),
    Key("parallelism.expert_*", IGNORED, "expert parallelism: a dense model has no experts"),
    Key("activation_checkpoint.mode", USED, "full: checkpoint:segments=all; selective: per operator or every k-th "
                                            "block; memory_budget: compile:budget"),
    Key("activation_checkpoint.selective_ac_option", USED, "op: selective_checkpoint:policy=every_other_mm; k: "
                                                           "every k-th transformer block"),
    Key("activation_checkpoint.memory_budget", USED, "compile:budget (mode memory_budget)"),
    Key("activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns", IGNORED,
        "matmuls always recomputed in per-op SAC, by module (moe.router.gate): a dense Llama has none"),
    Key("activation_checkpoint.preserve_rng_state", IGNORED, "the random state restored in recompute: a few bytes"),
    Key("activation_checkpoint.early_stop", NOT_MODELLED, "recompute stopping once the saved tensors exist: "
                                                          "the whole recompute predicted"),
    Key("activation_checkpoint.determinism_check", IGNORED, "checkpoint's debugging check: no tensors kept"),
    Key("activation_checkpoint.debug", IGNORED, "checkpoint's debugging output: host side"),
    Key("activation_checkpoint.visualize_memory_budget_pareto", IGNORED, "a plot written at compile time: host"),
    Key("compile.enable", USED, "compile:scope=layers (each transformer block)"),
    Key("compile.components", USED, "model: each transformer block compiled; loss: compile:loss=true"),
    Key("compile.backend", USED, "compile:backend"),
    Key("optimizer.name", USED, "the optimizer (AdamW: the workload's; Adam: optimizer:name=adam)"),
    Key("optimizer.implementation", USED, "optimizer:impl (fused by default)"),
    Key("optimizer.early_step_in_backward", USED, "optimizer_in_backward"),
    Key("optimizer.lr", IGNORED, _VALUES), Key("optimizer.eps", IGNORED, _VALUES),
    Key("optimizer.beta1", IGNORED, _VALUES), Key("optimizer.beta2", IGNORED, _VALUES),
    Key("optimizer.weight_decay", IGNORED, _VALUES),
    *(Key(section + name, fate, meaning) for section in ("quantize.linear.float8.", "float8.")
      for name, fate, meaning in _FLOAT8_KEYS),
    Key("quantize.*", IGNORED, "other low-precision converters: not enabled by model.converters"),
    Key("lr_scheduler.*", IGNORED, "the learning-rate schedule: values, not memory"),
    Key("job.*", IGNORED, _HOST), Key("profiling.*", IGNORED, "the profiler and memory snapshots: " + _HOST),
    Key("metrics.*", IGNORED, _HOST), Key("checkpoint.*", IGNORED, "saving and loading checkpoints: " + _HOST),
    Key("validation.*", IGNORED, "validation between steps: the training step is predicted"),
    Key("comm.*", IGNORED, "the process group's timeouts and traces: " + _HOST),
    Key("memory_estimation.*", IGNORED, "torchtitan's own estimator: not a training setting"),
    Key("experimental.*", IGNORED, "extra modules imported at start: " + _HOST),
    Key("debug.*", IGNORED, "seeds and determinism: values, not memory"),
    Key("fault_tolerance.*", NOT_MODELLED, "torchft's replica groups: not predicted (off by default)"),
)
