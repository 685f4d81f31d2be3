"""The bytes of a workload's parameters and optimizer state after one step, counted on the meta device: what every step
of a strategy that keeps them (`Strategy.keeps_training_state`) holds, so a lower bound of its peak (the planner's floor,
bench.analysis.plan_floor; checkpoint's budget search, `CaseMeter.state_floor`)."""

from __future__ import annotations

import torch

from workloads import get_workload


def training_state_bytes(workload_spec: str) -> int | None:
    """The bytes of the workload's parameters and of its optimizer's state after one step, as they are on the device,
    counted on the meta device (nothing allocated: an 8B model's are counted in a second); None where the model cannot
    be built there or its optimizer cannot step there (no floor: nothing is ruled out by it)."""
    workload = get_workload(workload_spec)
    try:
        with torch.device("meta"):
            model = workload.build_model()
        optimizer = workload.make_optimizer(model)
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.grad = torch.zeros_like(parameter)
        optimizer.step()  # the state an optimizer makes in its first step (Adam's moments), made here on meta
    except Exception:  # noqa: BLE001 - a model or optimizer meta tensors cannot run: no floor, nothing assumed
        return None
    # an optimizer's step counts are host tensors unless it is fused or capturable: only the device's are counted
    state = [value for values in optimizer.state.values() for value in values.values()
             if isinstance(value, torch.Tensor) and value.is_meta]
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *state])
