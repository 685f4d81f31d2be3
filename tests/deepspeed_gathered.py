"""One rank of the real-DeepSpeed check of ZeRO-3's gathering (tests/test_deepspeed_gathered.py): DeepSpeed's engine
and membench's zero3 each run the same tiny model forward and backward for three micro-batches on this rank of a
2-rank gloo group (DeepSpeed's CPU accelerator), under settings that each make DeepSpeed's parameter coordinator keep
or free gathered parameters differently; after each Linear's forward (its release done) the elements of the
partitioned parameters gathered whole are sampled, and the samples of each setting printed as one JSON line.

Run as `python -m tests.deepspeed_gathered ENGINE` under torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT); ENGINE is deepspeed or membench. The model and batch are tests/deepspeed_ranks.py's."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from tests.deepspeed_ranks import BATCH, PERSISTENCE, batch, model  # noqa: E402

MICRO_BATCHES = 3  # the first records the trace, the second uses it, the third is what it settles to
# (stage3_max_reuse_distance, stage3_prefetch_bucket_size, stage3_max_live_parameters), in elements: the weights are
# 576 elements each (the head's 48), the biases persistent
SETTINGS = {"freed_after_each_module": (0, 0, 1_000_000_000),
            "kept_for_the_backward": (1_000_000_000, 0, 1_000_000_000),
            "kept_within_the_reuse_distance": (700, 0, 1_000_000_000),
            "prefetched_within_max_live": (0, 600, 1200)}


def _sampler(samples: list[int], gathered) -> None:
    def sample(module, args, output):
        samples.append(gathered())
    return sample


def deepspeed_samples(reuse: int, prefetch: int, live: int) -> list[int]:
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    net = model()
    zero = {"stage": 3, "stage3_param_persistence_threshold": PERSISTENCE, "stage3_prefetch_bucket_size": prefetch,
            "stage3_max_live_parameters": live, "stage3_max_reuse_distance": reuse, "reduce_bucket_size": 1000}
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": MICRO_BATCHES,
              "zero_optimization": zero, "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters()), config=config)
    samples: list[int] = []
    gathered = lambda: sum(p.ds_numel for p in net.parameters()  # noqa: E731
                           if not p.ds_persist and p.ds_status != ZeroParamStatus.NOT_AVAILABLE)
    for module in net.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(_sampler(samples, gathered))
    x, y = batch()
    for _ in range(MICRO_BATCHES):
        engine.backward(nn.functional.cross_entropy(engine(x), y))
    return samples


def membench_samples(reuse: int, prefetch: int, live: int) -> list[int]:
    from strategies import STRATEGIES

    strategy = STRATEGIES.get("zero3")(param_persistence_threshold=PERSISTENCE, prefetch_bucket_size=prefetch,
                                       max_live_parameters=live, max_reuse_distance=reuse, reduce_bucket_size=1000)
    net = model()
    strategy.wrap_optimizer(torch.optim.AdamW(net.parameters()), net)
    samples: list[int] = []
    for module in net.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(_sampler(samples, strategy._live_elements))
    x, y = batch()
    for _ in range(MICRO_BATCHES):
        strategy.backward(nn.functional.cross_entropy(net(x), y))
    return samples


if __name__ == "__main__":
    engine = sys.argv[1]
    if engine == "deepspeed":
        import deepspeed
        import deepspeed.comm.torch as ds_torch

        ds_torch.build_shm_op = lambda: None  # gloo's collectives, no compiled op
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    run = deepspeed_samples if engine == "deepspeed" else membench_samples
    result = {name: run(*setting) for name, setting in SETTINGS.items()}
    sys.stdout.flush()  # one write(2) of the whole line: the two ranks share the pipe
    os.write(sys.stdout.fileno(), ("GATHERED " + json.dumps({"rank": dist.get_rank(), **result}) + "\n").encode())
    dist.barrier()
    dist.destroy_process_group()
