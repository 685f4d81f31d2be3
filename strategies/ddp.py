"""DistributedDataParallel: every rank holds the whole model and optimizer; gradients are averaged across ranks."""

from strategies import register_strategy
from strategies.framework.sharding import Sharded, data_parallel


@register_strategy
class DDP(Sharded):
    """The replicated reference of sharded training: each rank keeps full weights, gradients and optimizer state,
    and DDP's all-reduce averages the gradients (in buckets, overlapping the backward). Exact up to the order of
    float sums in the all-reduce; a BatchNorm model does not match (per-rank statistics).

    Limitations: it needs `--ranks 2` or more (in one process the row is `unsupported`), and a batch of at least
    one sample per rank. A BatchNorm model differs from the single process (each rank normalises its own shard),
    and so does a batch the ranks do not divide evenly (the first ranks get one sample more, so the gradients
    weigh samples unequally). On the CPU the ranks run over gloo."""

    name = "ddp"
    description = "DistributedDataParallel over --ranks processes: replicated weights, gradients, optimizer state"
    priority = 70  # wraps the model after the single-process transforms (checkpoint, in-place ReLU)

    def prepare_model(self, model, units):
        return data_parallel(model)

    def rank_signature(self, rank, world):
        """Every rank holds the whole model, its gradients and its optimizer state: ranks differ only by their
        share of the batch."""
        return ("samples", self.samples_of_rank(rank, world))
