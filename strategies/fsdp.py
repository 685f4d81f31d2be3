"""FSDP2: parameters, gradients and optimizer state sharded across ranks (`fully_shard` on each unit and the root).

The buffers of its collectives are filed as communication in the breakdown (`bench.core.memory_categories`), where
FSDP2 allocates them: the flat all-gather output (its `AllGather.allocate`), the flat reduce-scatter input and
output (`ReduceScatter.allocate`; the output becomes the sharded gradients). The unsharded parameters (each
parameter's own all-gather output, which the flat buffer is copied into) are weights.
"""

import warnings

from bench.core.memory_categories import COMMUNICATION, WEIGHTS, allocating, file_as, listening
from strategies.base import register_strategy
from strategies.sharding import Sharded, rank_and_world

# FSDP2 warns when a wrapped model returns a view (the captcha ResNet's reshaped softmax) that an in-place op could
# break; the runner never modifies a model's output in place, so the warning would only be noise in every run.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor", category=UserWarning)


def _communication_comms():
    """FSDP2's default all-gather and reduce-scatter, whose buffers are allocated as communication (imported here:
    torch.distributed.fsdp pulls in DTensor, over a second of every CLI start)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class CommunicationAllGather(DefaultAllGather):
        def allocate(self, size, *, dtype, device):
            with allocating(COMMUNICATION):
                return super().allocate(size, dtype=dtype, device=device)

    class CommunicationReduceScatter(DefaultReduceScatter):
        def allocate(self, size, *, dtype, device):
            with allocating(COMMUNICATION):
                return super().allocate(size, dtype=dtype, device=device)

    return CommunicationAllGather(), CommunicationReduceScatter()


def _file_unsharded_as_weights(module, args):
    """A forward pre-hook that runs after FSDP2's own (which all-gathers the unit): the unit's parameters are now
    its unsharded ones (each a view of its own all-gather output, a storage FSDP2 keeps and resizes to nothing
    between uses), filed as weights from this first forward on."""
    if listening():  # the units inside it are still sharded (DTensors, their shards weights already)
        file_as((p for p in module.parameters() if not hasattr(p, "_local_tensor")), WEIGHTS)


@register_strategy
class FSDP(Sharded):
    """`torch.distributed.fsdp.fully_shard` on each of the workload's checkpoint units (that owns parameters) and
    on the root: each rank keeps 1/N of every parameter, gradient and optimizer state, and all-gathers a unit's
    parameters just before it runs (freeing them after), so the peak holds one unit's full weights at a time.
    Composes with checkpoint and amp. Exact up to float summation order; BatchNorm models do not match."""

    name = "fsdp"
    description = "FSDP2 fully_shard per checkpoint unit and root: parameters, gradients, optimizer state sharded"
    priority = 70

    def prepare_model(self, model, units):
        """`fully_shard` on each unit with parameters, then on the root, over one mesh of the case's device: without
        `mesh`, FSDP2 takes torch's default accelerator (CUDA wherever torch sees a GPU) and moves the model there,
        so a `--device cpu` case would train on the GPU."""
        # imported here: torch.distributed.fsdp pulls in DTensor, over a second of every CLI start
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        _, world = rank_and_world()
        mesh = DeviceMesh(self.context.device, list(range(world)))
        sharded = [unit for unit in units if any(True for _ in unit.parameters())]
        for unit in sharded:
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        all_gather, reduce_scatter = _communication_comms()
        for module in (*sharded, model):
            module.set_custom_all_gather(all_gather)
            module.set_custom_reduce_scatter(reduce_scatter)
            module.register_forward_pre_hook(_file_unsharded_as_weights)
        return model
