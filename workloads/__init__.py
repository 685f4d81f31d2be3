"""Workloads: one module per model, registered by name (see `workloads.Workload`), or the user's own. This folder
holds the plug-ins, one module per workload; their framework (the API, spec resolution, the `hf:` configuration
readers, the data generators) is in `workloads.framework`, and a plug-in imports the API below from `workloads`."""

from bench.core.registry import import_modules_of
from workloads.framework.base import (
    WORKLOADS, DeferredHead, Trait, Workload, register_workload, tensors_of, to_device, to_float32,
)
from workloads.framework.loader import load_entry_points, resolve_workload

# Importing a workload module registers it; one module per workload, found in this folder (not listed here).
import_modules_of(__name__)

__all__ = [
    "WORKLOADS", "DeferredHead", "Trait", "Workload", "get_workload", "register_workload", "tensors_of", "to_device",
    "to_float32", "workload_names",
]


def get_workload(spec) -> Workload:
    """A new Workload for `spec` (a name with options, or the user's `file.py:NAME`); an instance is returned as is."""
    if isinstance(spec, Workload):
        return spec
    return resolve_workload(spec)


def workload_names() -> list[str]:
    """Every registered workload name, entry points included."""
    load_entry_points()
    return WORKLOADS.names()
