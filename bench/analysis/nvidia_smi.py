"""What nvidia-smi shows for a training process besides PyTorch's caching allocator: the terms of a predicted
nvidia-smi figure (the CUDA context, the allocator's reserved memory), each named.

nvidia-smi's "used" memory of a process is the CUDA context (the driver's state and the kernel images loaded
into it: PyTorch's, and cuBLAS's and cuDNN's when their handles load them) plus every device allocation, which for a
PyTorch process is what the caching allocator has reserved (`torch.cuda.memory_reserved`; it returns nothing to
the driver without `empty_cache`, so after a run it is the peak of reserved) and whatever a library allocates on
its own outside it.

The context term is, in this order of preference:
- the source's own measurement of the same process before the step (`process_baseline`: nvidia-smi after a first
  tiny tensor, as Hugging Face's guide prints it), less the caching allocator's segment that tensor occupies (a
  request of at most 1 MiB takes a 2 MiB small-pool segment: `bench.measure.cuda_allocator`);
- else the figure for CUDA's lazy module loading (PyTorch's builds since 2.0; `bench.core.gpus.CUDA_CONTEXT_BYTES`),
  where only the kernels a process runs are loaded.
Nothing here is keyed to a model, a source or a row: the terms are the allocator's and the driver's.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.core.gpus import CUDA_CONTEXT_BYTES
from bench.core.units import MiB
from bench.measure import cuda_allocator


@dataclass(frozen=True)
class Term:
    """One named part of a predicted nvidia-smi figure, in bytes, and where its figure comes from."""

    name: str
    bytes: int
    basis: str

    def text(self) -> str:
        return f"{self.name}={self.bytes / MiB:,.0f} MiB ({self.basis})"


def segment_bytes(request_bytes: int) -> int:
    """The bytes the caching allocator reserves from the driver for one request made in a fresh process: a small
    request (at most 1 MiB) takes a 2 MiB segment, a request under 10 MiB a 20 MiB one, a larger one is rounded up
    to 2 MiB (PyTorch's CUDACachingAllocator, `bench.measure.cuda_allocator`)."""
    return cuda_allocator.allocation_size(cuda_allocator.round_size(request_bytes))


def context_term(process_baseline_bytes: int | None = None, baseline_tensor_bytes: int = 4) -> Term:
    """The CUDA context: from the source's measurement of the process holding one tensor of
    `baseline_tensor_bytes` (torch.ones((1, 1)) is 4 bytes), less that tensor's segment; else the lazy-loading
    figure."""
    if process_baseline_bytes is not None:
        segment = segment_bytes(baseline_tensor_bytes)
        return Term("cuda_context", process_baseline_bytes - segment,
                    f"the source's nvidia-smi with one {baseline_tensor_bytes}-byte tensor, less its "
                    f"{segment // MiB} MiB allocator segment")
    return Term("cuda_context", CUDA_CONTEXT_BYTES, "CUDA lazy module loading, PyTorch >= 2.0; not measured by the "
                                                   "source")


def nvidia_smi_terms(reserved_bytes: int, process_baseline_bytes: int | None = None) -> list[Term]:
    """The terms of a predicted nvidia-smi figure: the context and the predicted peak of reserved memory (which
    holds cuBLAS's workspaces: PyTorch allocates them through the caching allocator)."""
    return [context_term(process_baseline_bytes),
            Term("reserved", reserved_bytes, "predicted max_memory_reserved, cuBLAS workspaces included")]


def describe(terms: list[Term]) -> str:
    """`cuda_context=... MiB (...); reserved=... MiB (...)`: the row's account of its figure."""
    return "; ".join(term.text() for term in terms)


# outside the caching allocator and not in the terms above: named in each nvidia-smi row
NOT_MODELLED = ("kernel images cuBLAS/cuDNN load into the context when their first handle is created, where the "
                "source's baseline was taken before any matrix product (eager module loading before CUDA 11.7)")
