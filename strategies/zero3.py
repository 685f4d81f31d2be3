"""DeepSpeed ZeRO stage 3: parameters too partitioned across ranks, gathered module by module as they run."""

from strategies import register_strategy
from strategies.framework.deepspeed_zero3 import Zero3Mechanism


@register_strategy
class Zero3(Zero3Mechanism):
    """DeepSpeed's ZeRO-3 as its `DeepSpeedZeroOptimizer_Stage3` and parameter coordinator allocate it
    (strategies/framework/deepspeed_zero3.py, with the DeepSpeed source it follows): each parameter split into N
    partitions of ceil(numel / N) elements, held in one flat buffer, the float32 master copy and the optimizer state
    of the rank's partitions, a persistent gradient-partition buffer and bucket; each module's own parameters
    all-gathered just before its forward and its backward and freed after unless used again within
    `max_reuse_distance` elements of the modules that follow (DeepSpeed's default, 1e9, keeps a smaller model's
    parameters gathered from their forward to their backward), those next in the first micro-batch's order gathered
    ahead up to `prefetch_bucket_size` elements within `max_live_parameters`; a parameter of at most
    `param_persistence_threshold` elements kept whole on every rank; in the forward `F.linear` saves the weight
    parameter itself (DeepSpeed's memory-efficient linear), so a released weight is not kept by autograd. Options: those of `zero2`, `sub_group_size`,
    the four above (DeepSpeed's `stage3_` keys) and `offload_param=cpu` (the 16-bit partitions on the host; CUDA
    only). Exact up to float summation order in float32.

    Limitations: it needs `--ranks 2` or more; a BatchNorm model differs from the single process. DeepSpeed's engine
    is not run (see zero2's limitations); in backward only the root and the modules with parameters of their own are
    fetched (DeepSpeed fetches every module: its prefetch can run a module earlier there); DeepSpeed frees the
    persistent parameters in its first micro-batch and gathers them again in the second, membench keeps them whole
    (tests/test_deepspeed_gathered.py); a parameter read outside its own module's
    forward (a parent reading a child's weight directly) is not gathered for it. In backward a trainable parameter
    is freed once its gradient is accumulated, where DeepSpeed frees it when its module's backward ends: a weight
    shared by two modules (an embedding tied to the output head) stays gathered from the head's backward to the end of
    the backward, more than DeepSpeed holds. Offload's host memory is
    `offload_host_peak_bytes`, not in `peak_mem_bytes`."""

    name = "zero3"
    description = "DeepSpeed ZeRO-3 (modelled): parameters, gradients and optimizer state partitioned"
    priority = 70
    # DeepSpeed's default bucket is 5e8 elements: 2 GB of a small test's host memory
    test_spec = "zero3:reduce_bucket_size=4096:param_persistence_threshold=16:prefetch_bucket_size=2048"
