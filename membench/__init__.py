"""membench from Python: estimate, measure, plan and fit the memory of a training step of your own model.

    >>> import torch, membench
    >>> build = lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    >>> batch = (torch.randn(32, 64), torch.randint(10, (32,)))
    >>> membench.estimate(build, batch, torch.nn.functional.cross_entropy, gpu="H100").fits("H100")
    True

See docs/python-api.md. The command line (`python -m bench`) is unchanged; this package sits on top of it.
"""

from membench.dry_run import DryRun, dry_run
from membench.estimating import Estimate, estimate
from membench.measuring import Measurement, StepMemory, measure
from membench.planning import Plan, fit, plan
from membench.workload import CallableWorkload, InputError, Shape, check_inputs, workload_from_callables

__all__ = ["CallableWorkload", "DryRun", "dry_run", "Estimate", "InputError", "Measurement", "Shape", "StepMemory",
           "check_inputs", "estimate", "fit", "measure", "Plan", "plan", "workload_from_callables"]
