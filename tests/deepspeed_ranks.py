"""One rank of the real-DeepSpeed check (tests/test_deepspeed_zero.py): DeepSpeed's engine and membench's zero2/zero3
mechanism each train the same tiny model one step on this rank of a 2-rank gloo group (DeepSpeed's CPU
accelerator), and the bytes each keeps, by what they are, are printed as one JSON line.

Run as `python -m tests.deepspeed_ranks STAGE OFFLOAD` under torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). DeepSpeed's shared-memory all-reduce (a C++ op it compiles at its first start) is not
built: its collectives are torch.distributed's over gloo, as membench's are. The optimizer is torch's AdamW given to
DeepSpeed as the client optimizer, so that no DeepSpeed kernel is compiled (DeepSpeedCPUAdam keeps the same two
float32 moments)."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

WIDTH, LAYERS, BATCH = 24, 3, 4
BUCKET_ELEMENTS = 1000  # smaller than the model: several buckets
PERSISTENCE = 30  # ZeRO-3: the biases (24 elements) stay whole, the weights (576) are partitioned


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(LAYERS)],
                         nn.Linear(WIDTH, 2))


def nbytes(tensors) -> int:
    """Bytes of the distinct storages of `tensors` (None and 0-element ones left out)."""
    storages = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def state_bytes(optimizer) -> int:
    return nbytes(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim())


def batch():
    torch.manual_seed(1 + dist.get_rank())
    return torch.randn(BATCH, WIDTH), torch.randint(0, 2, (BATCH,))


def deepspeed_inventory(stage: int, offload: bool) -> dict:
    import deepspeed
    import deepspeed.comm.torch as ds_torch

    ds_torch.build_shm_op = lambda: None  # gloo's collectives, no compiled op
    deepspeed.init_distributed(dist_backend="gloo")
    net = model()
    zero = {"stage": stage, "reduce_bucket_size": BUCKET_ELEMENTS, "contiguous_gradients": True,
            "overlap_comm": stage == 3}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=PERSISTENCE, stage3_prefetch_bucket_size=0)
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "zero_optimization": zero,
              "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
    engine, optimizer, _, _ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters()),
                                                   config=config)
    x, y = batch()
    loss = nn.functional.cross_entropy(engine(x), y)
    engine.backward(loss)
    if stage == 2:  # the gradients' views of grads_in_partition, and what the epilogue gathered for the step
        held = [*optimizer.all_grad_tensors.values(), *optimizer.averaged_gradients.values()]
        grads = nbytes([p.grad for p in net.parameters()] + [t for ts in held if ts is not None for t in
                                                              (ts if isinstance(ts, list) else [ts])])
        flat = nbytes(optimizer.bit16_groups_flat)
        masters = nbytes(optimizer.single_partition_of_fp32_groups)
        host_grads = nbytes(m.grad for m in optimizer.single_partition_of_fp32_groups)
    else:
        grads = nbytes([optimizer.grad_partitions_flat_buffer])
        flat = nbytes([optimizer.lp_param_buffer])
        masters = nbytes(optimizer.fp32_partitioned_groups_flat)
    engine.step()
    inventory = {"params": flat, "masters": masters, "grads_after_backward": grads,
                 "optimizer_state": state_bytes(optimizer.optimizer)}
    if stage == 2:  # the float32 gradient partition offload keeps on the host between steps
        inventory["fp32_grad_buffer"] = host_grads
    if stage == 3:
        inventory["bucket"] = nbytes(bucket.buffer for bucket in optimizer.ipg_buckets.values())
        inventory["fp32_grad_buffer"] = nbytes(m.grad for m in optimizer.fp32_partitioned_groups_flat)
        inventory["whole_params"] = nbytes(p.data for p in net.parameters())  # the persistent ones
    return inventory


def membench_inventory(stage: int, offload: bool) -> dict:
    from strategies import STRATEGIES

    dist.init_process_group("gloo")
    options = {"reduce_bucket_size": BUCKET_ELEMENTS, "overlap_comm": stage == 3}
    if stage == 3:
        options.update(param_persistence_threshold=PERSISTENCE, prefetch_bucket_size=0)
    if offload:
        options["offload_optimizer"] = "cpu"
    strategy = STRATEGIES.get(f"zero{stage}")(**options)
    net = model()
    optimizer = strategy.wrap_optimizer(torch.optim.AdamW(net.parameters()), net)
    x, y = batch()
    strategy.backward(nn.functional.cross_entropy(net(x), y))
    if stage == 2:
        grads = nbytes([p.grad for p in net.parameters()])
        flat = nbytes(g.flat for g in strategy.groups)
        masters = nbytes(g.master for g in strategy.groups)
        host_grads = nbytes(g.host_grad for g in strategy.groups)
    else:
        grads = nbytes([strategy.grad_buffer])
        flat = nbytes([strategy.lp_buffer])
        masters = nbytes(strategy.masters)
    strategy.optimizer_step(optimizer)
    inventory = {"params": flat, "masters": masters, "grads_after_backward": grads,
                 "optimizer_state": state_bytes(optimizer)}
    if stage == 2:
        inventory["fp32_grad_buffer"] = host_grads
    if stage == 3:
        inventory["bucket"] = nbytes(strategy.bucket.buffers)
        inventory["fp32_grad_buffer"] = nbytes(strategy.fp32_grads)
        inventory["whole_params"] = nbytes(p.data for p in net.parameters())
    return inventory


if __name__ == "__main__":
    engine, stage, offload = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "cpu"
    inventory = (deepspeed_inventory if engine == "deepspeed" else membench_inventory)(stage, offload)
    # one write(2) of the whole line (under PIPE_BUF): the two ranks share the pipe, and print's separate writes of
    # the text and its newline let the other rank's line land between them
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), ("INVENTORY " + json.dumps({"rank": dist.get_rank(), **inventory}) + "\n").encode())
    dist.barrier()
    dist.destroy_process_group()
