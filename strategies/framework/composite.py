"""Strategies applied together (`checkpoint+amp`): one Composite that enters each member's hooks around the stage
each concerns, in priority order, and checks that they compose."""

from __future__ import annotations

import contextlib

from bench.core.errors import UsageError
from strategies.framework.base import EXACT, PlanMeter, StepContext, Strategy


def _overrides(strategy: Strategy, hook: str) -> bool:
    return getattr(type(strategy), hook) is not getattr(Strategy, hook)


def members_of(strategy: Strategy) -> list[Strategy]:
    """The strategies a (composed or single) strategy applies: a Composite's members, else itself."""
    return getattr(strategy, "members", [strategy])


def recompute_plan_of(strategy: Strategy) -> str:
    """What a strategy recomputes in backward, composed or not: its own checkpointing plan's `recompute_plan()`
    (`0 1 2 3`, `0-4 5-9`, `each unit, saving compute`) or that of its first member that has one; `none` when
    nothing is recomputed. Known once its model was prepared."""
    return next((plan for m in members_of(strategy) if (plan := m.recompute_plan()) is not None), "none")


class Composite(Strategy):
    """Several strategies applied together; built by `parse_strategy("a+b")`, order-independent."""

    def __init__(self, members: list[Strategy]):
        self.members = sorted(members, key=lambda s: (s.priority, s.name))
        names = [m.name for m in self.members]
        if len(set(names)) != len(names):
            raise UsageError(f"strategy {'+'.join(names)!r} names a strategy twice")
        for m in self.members:
            for other in m.conflicts:
                if other in names:
                    raise UsageError(f"strategies {m.name!r} and {other!r} cannot be combined")
        for hook in ("load_batch", "micro_batches", "backward", "unscale_grads", "optimizer_step", "zero_grad",
                     "shard_batch", "reduce_loss"):
            # members that share one implementation (the sharded strategies' batch split) compose
            implementations = {getattr(type(m), hook): m.name for m in self.members if _overrides(m, hook)}
            owners = list(implementations.values())
            if len(owners) > 1:
                raise UsageError(f"strategies {owners[0]!r} and {owners[1]!r} cannot be combined: both replace {hook}")
        sharded = [m for m in self.members if m.distributed]
        for i, m in enumerate(sharded):
            for other in sharded[i + 1:]:
                if other.name not in getattr(m, "shards_with", ()) and m.name not in getattr(other, "shards_with", ()):
                    raise UsageError(f"strategies {m.name!r} and {other.name!r} cannot be combined: both split the "
                                     "training across the ranks")
        self.name = "+".join(names)
        self.distributed = any(m.distributed for m in self.members)
        self.pitfall = any(m.pitfall for m in self.members)
        self.keeps_training_state = all(m.keeps_training_state for m in self.members)
        self.row_columns = tuple(column for m in self.members for column in m.row_columns)
        counts = {m.cpu_memory_count for m in self.members} - {"live_tensors"}
        self.cpu_memory_count = counts.pop() if counts else "live_tensors"
        self.description = "; ".join(m.description for m in self.members)
        self.settings = {}
        self.tolerance = EXACT
        for m in self.members:
            self.tolerance = self.tolerance.loosest(m.tolerance)
        self.context = StepContext(phase="train", device="cpu")

    def _owner(self, hook: str) -> Strategy:
        return next((m for m in self.members if _overrides(m, hook)), Strategy())

    def bind(self, context):
        self.context = context
        for m in self.members:
            m.bind(context)

    def check(self, context):
        for m in self.members:
            m.check(context)

    @contextlib.contextmanager
    def _entered(self, hook: str):
        with contextlib.ExitStack() as stack:
            for m in self.members:
                stack.enter_context(getattr(m, hook)())
            yield

    def session(self):
        return self._entered("session")

    def forward(self):
        return self._entered("forward")

    def prepare_model(self, model, units):
        for m in self.members:
            model = m.prepare_model(model, units)
        return model

    def prepare_loss(self, loss):
        for m in self.members:
            loss = m.prepare_loss(loss)
        return loss

    def shard_batch(self, batch):
        return self._owner("shard_batch").shard_batch(batch)

    def wrap_optimizer(self, optimizer, model):
        for m in self.members:
            optimizer = m.wrap_optimizer(optimizer, model)
        return optimizer

    def load_batch(self, host_batch, device_batch):
        return self._owner("load_batch").load_batch(host_batch, device_batch)

    def micro_batches(self, inputs, target):
        return self._owner("micro_batches").micro_batches(inputs, target)

    def reduce_loss(self, loss):
        return self._owner("reduce_loss").reduce_loss(loss)

    def backward(self, loss):
        self._owner("backward").backward(loss)

    def unscale_grads(self, optimizer):
        self._owner("unscale_grads").unscale_grads(optimizer)

    def optimizer_step(self, optimizer):
        self._owner("optimizer_step").optimizer_step(optimizer)

    def zero_grad(self, optimizer):
        self._owner("zero_grad").zero_grad(optimizer)

    def accumulate_loss(self, loss_of_step):
        for m in self.members:
            m.accumulate_loss(loss_of_step)

    def end_step(self, kept):
        for m in self.members:
            m.end_step(kept)

    def rank_signature(self, rank, world):
        signatures = [m.rank_signature(rank, world) for m in self.members]
        return None if any(signature is None for signature in signatures) else tuple(signatures)

    def differs_by_design(self):
        reasons = [reason for m in self.members if (reason := m.differs_by_design())]
        return "; ".join(reasons) or None

    def baseline_parameter_name(self, name):
        for m in reversed(self.members):  # the last transform's renaming is undone first
            name = m.baseline_parameter_name(name)
        return name

    def recomputed_groups(self):
        return next((groups for m in self.members if (groups := m.recomputed_groups()) is not None), None)

    def plan(self, meter):
        for m in self.members:
            m.plan(_MemberMeter(meter, self, m))

    def describe(self):
        described = {}
        for m in self.members:
            described.update(m.describe())
        return described

    def replayable_calls(self):
        return [call for m in self.members for call in m.replayable_calls()]

    def columns(self):
        measured = {}
        for m in self.members:
            measured.update(m.columns())
        return measured

    def spec(self):
        return "+".join(m.spec() for m in self.members)


class _MemberMeter(PlanMeter):
    """A member's view of its composite's meter: a candidate for the member is measured with the other members."""

    def __init__(self, meter: PlanMeter, composite: Composite, member: Strategy):
        self.meter, self.composite, self.member = meter, composite, member

    def _with(self, candidate: Strategy) -> Strategy:
        combined = Composite([candidate if m is self.member else m for m in self.composite.members])
        combined.context = self.composite.context
        return combined

    def predicted_peak(self, strategy):
        return self.meter.predicted_peak(self._with(strategy))

    def measured_peak(self, strategy):
        return self.meter.measured_peak(self._with(strategy))

    def baseline_peak(self):
        return self.meter.baseline_peak()

    def unit_flops(self):
        return self.meter.unit_flops()

    def state_floor(self, strategy):
        return self.meter.state_floor(self._with(strategy))
