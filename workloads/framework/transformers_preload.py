"""Imported by a search's fork server before it forks the workers of an `hf:` workload (`bench.analysis.pools`):
transformers and torchvision imported once there, not again by each worker's first candidate, and frozen out of
the collector's reach as `import_transformers` freezes them. What asks torch about CUDA devices (torchao,
`transformers.modeling_utils`) is left to the workers: a child forked from a process that did cannot use CUDA.
Nothing where transformers is not installed: the workers say so."""

import contextlib

from bench.core.collector import frozen_after
from workloads.framework.transformers_import import import_transformers_before_cuda

with contextlib.suppress(ImportError), frozen_after():
    import_transformers_before_cuda()
