"""FSDP2: parameters, gradients and optimizer state sharded across ranks (`fully_shard` on each unit and the root)."""

import warnings

from strategies.base import register_strategy
from strategies.sharding import Sharded, rank_and_world

# FSDP2 warns when a wrapped model returns a view (the captcha ResNet's reshaped softmax) that an in-place op could
# break; the runner never modifies a model's output in place, so the warning would only be noise in every run.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor", category=UserWarning)


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
        self.parameter_rows = [p.shape[0] if p.dim() else 1 for p in model.parameters()]
        mesh = DeviceMesh(self.context.device, list(range(world)))
        for unit in units:
            if any(True for _ in unit.parameters()):
                fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def rank_signature(self, rank, world):
        """A rank holds dim-0 chunk `rank` of every parameter (torch.chunk's split, as FSDP2 shards: chunks of
        ceil(rows / world) rows, the last ones shorter or empty) and its share of the batch; ranks whose chunks
        and share are all the same size allocate the same."""
        def rows_of_chunk(rows: int) -> int:
            chunk = -(-rows // world)
            return max(0, min(chunk, rows - rank * chunk))

        return ("samples", self.samples_of_rank(rank, world),
                "rows", tuple(rows_of_chunk(rows) for rows in self.parameter_rows))
