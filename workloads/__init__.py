"""Workloads: one module per model, registered by name (see `workloads.base.Workload`)."""

from workloads.base import WORKLOADS, Workload, register_workload

# Importing a workload module registers it.
from workloads import captcha_resnet18  # noqa: E402,F401

__all__ = ["WORKLOADS", "Workload", "register_workload", "get_workload"]


def get_workload(name: str) -> Workload:
    """A new instance of the workload registered as `name` (UsageError listing the choices otherwise)."""
    return WORKLOADS.get(name)()
