"""`torch.cuda.empty_cache()` after every step: the caching allocator gives its free blocks back to the driver."""

import torch

from strategies import Strategy, register_strategy


@register_strategy
class EmptyCache(Strategy):
    """Releases the allocator's cached, unused blocks at the end of each step (the memory-saving article).

    Allocated memory, and so `peak_mem_bytes`, is the baseline's: only reserved memory (`peak_reserved_bytes`, what
    `nvidia-smi` shows) can fall, and it falls only between steps; the next step takes the blocks back from the
    driver with cudaMalloc, which costs time. Useful only to hand memory to another process. Exact; CUDA only (the
    CPU has no caching allocator): `unsupported` on the CPU.

    Limitations: `peak_mem_bytes` cannot fall; the re-allocation it causes costs time, which the planner does
    not model (`plan_excluded`), and `predict`'s model of the caching allocator assumes no `empty_cache`, so a
    prediction does not show the memory it gives back between steps.
    """

    name = "empty_cache"
    description = "torch.cuda.empty_cache() after each step: lower reserved memory, slower steps"
    devices = ("cuda",)
    plan_excluded = ("lowers reserved memory between steps, not the step's peak; its cost (re-allocation) is not "
                     "modelled")

    def end_step(self, kept):
        torch.cuda.empty_cache()
