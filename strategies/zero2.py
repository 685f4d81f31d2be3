"""DeepSpeed ZeRO stage 2: optimizer state, float32 master weights and gradients partitioned across ranks."""

from strategies import register_strategy
from strategies.framework.deepspeed_zero import Zero2Mechanism


@register_strategy
class Zero2(Zero2Mechanism):
    """DeepSpeed's ZeRO-2 as its `DeepSpeedZeroOptimizer` allocates it (strategies/framework/deepspeed_zero.py, with
    the DeepSpeed source it follows): the trainable parameters flattened into one buffer per parameter group and kept
    whole on every rank, each rank's float32 master copy and optimizer state of 1/N of it, the gradients copied into
    a bucket of `reduce_bucket_size` elements as backward makes them, averaged across the ranks a bucket at a time,
    and kept only for the parameters of the rank's partition. Options: `reduce_bucket_size` (elements),
    `overlap_comm` (a second bucket), `contiguous_gradients` (false: no bucket, each gradient reduced where it is),
    `offload_optimizer=cpu` (the master and the optimizer's state on the host; CUDA only). `python -m bench predict
    --config ds_config.json` derives them from a DeepSpeed configuration (bench/jobs/deepspeed.py). Exact up to float
    summation order in float32; a 16-bit model (DeepSpeed's `bf16` section: `bf16_weights+zero2`) keeps float32
    masters, and its row differs from float32 by design.

    Limitations: it needs `--ranks 2` or more; a BatchNorm model differs from the single process (per-rank
    statistics). DeepSpeed's engine is not run: its partitioning is modelled with torch's tensors and collectives, so
    a kernel's own workspace (DeepSpeedCPUAdam's, a fused Adam's) and the reduction's temporaries inside NCCL are not
    counted, and the all-reduce of a bucket stands for DeepSpeed's reduce to the owning ranks (the same buffers, more
    traffic). Gradient accumulation across micro-batches is predicted as the bucket's reduction of each
    micro-batch. Loss scaling (DeepSpeed's `fp16`) is not modelled. Offload's host memory is not in `peak_mem_bytes`:
    it is `offload_host_peak_bytes`, counted right after each optimizer step."""

    name = "zero2"
    description = "DeepSpeed ZeRO-2 (modelled): master weights, optimizer state and gradients partitioned"
    priority = 70
    # DeepSpeed's default bucket is 5e8 elements: 2 GB of a small test's host memory
    test_spec = "zero2:reduce_bucket_size=4096"
