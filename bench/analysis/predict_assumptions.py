"""What a prediction assumes, as `predict` prints it under its table: each engine's own lines, then those of every
CUDA prediction (the allocator model, what max_memory_allocated counts and what nothing models)."""

from __future__ import annotations

from typing import Iterable

# What each engine assumes (printed for the engines a table used), then what every CUDA prediction assumes.
ENGINE_ASSUMPTIONS = {
    "fake-cuda": [
        "engine fake-cuda: the step (after CUDA's 2 warm-up steps) runs CUDA's own operators on PyTorch's fake"
        " tensors, under the exact live-tensor tracker, in a CUDA build of torch (on a machine without a GPU the"
        " fake-CUDA environment's, .venv-cuda-fake, whose CUDA libraries are stubs): CUDA's autocast op lists in"
        " float16, cuDNN's batch norm, GradScaler's unscaling, the optimizers' multi-tensor (foreach)"
        " implementations and their temporaries; no kernel runs, so choices a kernel or library makes at run time"
        " are not seen, and choices that depend on the GPU model are made for the device that torch sees (the"
        " stubs' is an H100-like compute capability 9.0), whatever --capability says, but for the one below",
        "engine fake-cuda: each scaled_dot_product_attention call runs the kernel CUDA chooses (column sdpa_kernel:"
        " flash, efficient, cudnn or math), forced in the trace (a checkpointed layer's recompute in backward included)"
        " so that its outputs (logsumexp, cuDNN's statistics,"
        " math's whole attention matrix) are what is counted: PyTorch's priority order and hardware ranges for"
        " --capability (cuDNN first on 9.x/10.x with cuDNN > 9.15), its own checks of dtype, head dimension,"
        " grouped-query heads, mask and dropout for the device torch sees; under autocast for the inputs autocast"
        " casts; memory a kernel allocates outside tensors (cuDNN's workspace) is not counted",
    ],
    "fake": [
        "engine fake: the step (after CUDA's 2 warm-up steps) runs under the exact live-tensor tracker on PyTorch's"
        " fake tensors with the CPU's operators (no arithmetic); the CPU and CUDA kernels are assumed to return"
        " tensors of the same sizes (on the CPU a loss returns its scalar in a buffer of the loss's elements, on"
        " CUDA in a 512-byte block: fake tensors follow CUDA); the optimizers run their CPU implementation (Adam's"
        " per-parameter loop, where CUDA's foreach implementation holds a temporary of every parameter at once:"
        " when the optimizer step is the peak, as at small batches, CUDA's is higher)",
        "engine fake: autocast runs in float16 (CUDA's default) instead of the CPU's bfloat16, but with the CPU's op"
        " lists: ops that CUDA's autocast keeps in float32 and the CPU's does not (or the reverse) are off by their"
        " output size",
    ],
    "cpu": [
        "engine cpu: the step (after CUDA's 2 warm-up steps) runs for real on the CPU under the exact live-tensor"
        " tracker (where fake tensors cannot run the strategy, or for a sharded strategy's ranks), with autocast in"
        " float16 and the CPU's op lists; the CPU's kernels are assumed to return tensors of CUDA's sizes",
    ],
    "meta": [
        "engine meta: the step runs on meta tensors (shapes only) under the exact live-tensor tracker; autocast"
        " cannot run there (such a strategy is an error row)",
    ],
}

ASSUMPTIONS = [
    "allocated and reserved replay the tracker's exact sequence of allocations and frees through a model of CUDA's"
    " caching allocator with default settings (no PYTORCH_CUDA_ALLOC_CONF): 512-byte rounding, requests up to 1 MiB"
    " from 2 MiB segments, larger ones from 20 MiB segments (under 10 MiB) or rounded to 2 MiB, best fit, blocks"
    " split when the rest is >= 512 B (small) or > 1 MiB (large), an unsplit block counted whole; one stream, no"
    " empty_cache",
    "counted, as max_memory_allocated counts them: cuBLAS's workspace (8,519,680 B per thread that runs a matrix"
    " product, 32 MiB on compute capability 9.0, or as CUBLAS_WORKSPACE_CONFIG says), one for the forward's thread"
    " and one for autograd's backward thread",
    "counted, on a GPU of compute capability 9.0: cuDNN's convolution workspaces (allocated through the caching"
    " allocator after each convolution's outputs, freed when it returns), each call's from a table measured per"
    " convolution on an H200 (cuDNN 9.19; bench.measure.cudnn_workspace), estimated from the same convolution at"
    " other batch sizes where the table lacks the batch; not modelled on other GPUs or for a convolution the table"
    " lacks (the row says how many calls): there max_memory_allocated can exceed the prediction by the workspace of"
    " the convolution at the peak (unbounded: 140 MB seen at batch 16; CUDNN_CONV_WSCAP_DBG does not cap cuDNN's v8"
    " API); cudnn.benchmark's autotuning can also leave its trial workspaces' segments in max_memory_reserved",
    "counted: the scratch of CUDA's reduction kernel (sum, mean, prod, amax, amin), where it splits each output's"
    " inputs across thread blocks (a Linear's bias gradient, a norm's weight gradient: 48 MiB for 1,536 features"
    " over 4,096 tokens on an H200), sized by Reduce.cuh's launch configuration for the GPU's multiprocessors"
    " (bench.measure.cuda_reduction), allocated after the call's output and freed when it returns",
    "not counted, as max_memory_allocated does not count them: the CUDA context and kernels' own buffers outside"
    " the caching allocator",
    "by category: the allocator model's blocks at the allocated peak, by what their storage is (weights, gradients,"
    " optimizer state, activations: made in the forward; logits: tensors whose last dimension is the output head's"
    " output features, the vocabulary; other: the rest, cuBLAS's workspaces included); they sum to allocated",
    "full size: the model is built and stepped on fake tensors (its weights never exist, its initialisation"
    " draws no number); a decoder whose layers are all alike is traced at 3, 4 and 5 layers and its step's log"
    " built for all of them from the first two (layer replay), used only where the one built for 5 equals the"
    " 5-layer trace event for event (the row says so; MEMBENCH_FULL_TRACE=1 traces every layer), nothing"
    " extrapolated otherwise; the measured step of each trace but that proof's is its last warm-up step's log"
    " repeated, not run (a steady step allocates and frees what the step before it did; the proof runs every step);"
    " a checkpoint plan of checkpointed then plain layers is traced with both kinds kept"
    " (c+p layers) and proven the same way, where those traces hold at most 85% of its layers; each traced rank"
    " of fsdp is replayed the same way from its own traces; torchao's NF4 dequantisation (qlora) runs once per"
    " weight layout and stage, and its log (operators, allocations, frees) is logged again for the other calls of"
    " that layout, the same events (bench.measure.call_replay; MEMBENCH_FULL_TRACE=1 runs every call)",
]


def assumptions(engines: Iterable[str | None]) -> list[str]:
    """What a CUDA prediction made on `engines` (the rows' engine column) assumes: each engine's own lines, then
    those of every CUDA prediction (`ASSUMPTIONS`)."""
    used = [name for name in ENGINE_ASSUMPTIONS if name in set(engines)]
    return [line for name in used for line in ENGINE_ASSUMPTIONS[name]] + ASSUMPTIONS
