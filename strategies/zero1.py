"""ZeRO stage 1: DDP, with the optimizer's state sharded across ranks (ZeroRedundancyOptimizer)."""

import inspect

from strategies import register_strategy
from strategies.framework.sharding import Sharded, data_parallel


@register_strategy
class Zero1(Sharded):
    """Each rank keeps the optimizer state of 1/N of the parameters and updates only those, then broadcasts them;
    weights and gradients stay replicated (DDP). Adam's two moments are 2x the parameters: sharding them is where
    ZeRO-1 saves. Exact up to float summation order; BatchNorm models do not match (per-rank statistics).

    Limitations: it needs `--ranks 2` or more, and a BatchNorm model differs from the single process (per-rank
    statistics). ZeroRedundancyOptimizer gives each rank whole parameters (never part of one), so the ranks' shares
    of the optimizer state are as even as the parameters' sizes allow, not equal."""

    name = "zero1"
    description = "ZeRO-1: DDP with the optimizer state sharded across ranks (ZeroRedundancyOptimizer)"
    priority = 70

    def prepare_model(self, model, units):
        return data_parallel(model)

    def wrap_optimizer(self, optimizer, model):
        """The workload's optimizer, class, parameter groups and settings kept, with its state sharded."""
        # imported here: torch.distributed.optim pulls in FSDP and DTensor, over a second of every CLI start
        from torch.distributed.optim import ZeroRedundancyOptimizer

        accepted = inspect.signature(type(optimizer).__init__).parameters
        settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}  # AdamW's defaults hold more
        groups = [dict(group) for group in optimizer.param_groups]
        return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **settings)
