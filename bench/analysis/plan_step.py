"""How a plan candidate's step is traced (`bench.analysis.plan.evaluate`): its operators counted in the measured step
only, and a step stopped in its warm-up steps once the candidate certainly cannot fit.

Both change no figure of a candidate that runs to the end: the counter's list of the measured step is the one it
made when it also counted the warm-up steps (whose lists were thrown away), and a candidate is stopped only on a
bound that its judged memory cannot go under (tests/test_plan_step.py runs each candidate both ways).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from bench.core.schema import Row
from bench.core.results import Status
from bench.analysis.fake_engine import cublas_workspace
from bench.measure import cuda_allocator
from bench.measure.memory import LiveTensorTracker
from bench.measure.op_cost import OperatorCostCounter

# what the message of a candidate stopped once over the limit begins with (its peak and time are not predicted)
STOPPED_OVER_LIMIT = "does not fit (stopped early)"
# the moments of a warm-up step where a candidate may stop (`counted`)
FORWARD, BACKWARD = "in the forward (before a module ran)", "at the start of the backward"
OPTIMIZER, END = "at the start of the optimizer step", "at the end"


class MeasuredStepCounter(OperatorCostCounter):
    """The operator counter of a candidate's step that counts only while `armed` (its measured step, the last): the
    warm-up steps' operators were counted and thrown away (the row reads the last step's), and counting costs a
    tenth or more of a full-size trace. Unarmed it calls each operator as the counter does, and records nothing.
    `repeats_last_warmup`: the trace's measured step is its last warm-up step repeated, not run (bench.measure.
    step_repeat), whose operators are the measured step's: that step is the last it sees."""

    def __init__(self, repeats_last_warmup: bool = False):
        super().__init__()
        self.armed = False
        self.repeats_last_warmup = repeats_last_warmup

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.armed:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class OverLimit(Exception):
    """A candidate's step stopped once it certainly does not fit: the caching allocator's model had reserved
    `reserved_bytes` at a moment (`when`: BACKWARD, OPTIMIZER or END) of warm-up step `step`."""

    def __init__(self, reserved_bytes: int, step: int, when: str):
        super().__init__(f"{reserved_bytes} B reserved {when} of warm-up step {step}")
        self.reserved_bytes, self.step, self.when = reserved_bytes, step, when


def stopped_over_limit(row: Row) -> bool:
    """Whether `row` is a candidate stopped once it certainly did not fit (`plan.evaluate`'s `may_stop`)."""
    return row["status"] == Status.OK.value and row["judged_bytes"] is None \
        and (row["message"] or "").startswith(STOPPED_OVER_LIMIT)


def counted(strategy, counter: OperatorCostCounter, warmup_steps: int | None = None,
            check: "ReservedCheck | None" = None):
    """`strategy` with `counter` entered around its session and told where each step ends. With `warmup_steps` (a
    `MeasuredStepCounter`) the counter is armed for the step after them, the measured one; `check` (`ReservedCheck`)
    looks at each warm-up step where the strategy's hooks are called between operators, never inside one (an
    exception raised inside an operator of the backward ends the process): before each module's forward in the
    forward (a global forward pre-hook, silent from the backward's start, where a checkpoint's recompute runs
    modules inside an operator of the backward), when its backward starts, when its optimizer step starts, and at
    its end."""
    session, end_step = strategy.session, strategy.end_step
    backward, optimizer_step = strategy.backward, strategy.optimizer_step
    ended = [0]
    forwarding = [True]

    def look_in_forward(module, args):
        if forwarding[0] and in_warmup():
            check.look(ended[0] + 1, FORWARD)

    @contextlib.contextmanager
    def counted_session():
        with session(), counter, contextlib.ExitStack() as hooks:
            if check is not None:
                hooks.callback(torch.nn.modules.module.register_module_forward_pre_hook(look_in_forward).remove)
            yield

    def in_warmup() -> bool:
        return check is not None and warmup_steps is not None and ended[0] < warmup_steps

    def counted_end_step(kept):
        end_step(kept)
        counter.end_step()
        if in_warmup():
            check.look(ended[0] + 1, END, always=ended[0] == 0)
        ended[0] += 1
        forwarding[0] = True
        if warmup_steps:
            counter.armed = ended[0] == warmup_steps

    def checked_backward(loss):
        forwarding[0] = False
        if in_warmup():
            check.look(ended[0] + 1, BACKWARD)
        return backward(loss)

    def checked_optimizer_step(optimizer):
        if in_warmup():
            check.look(ended[0] + 1, OPTIMIZER)
        return optimizer_step(optimizer)

    strategy.session, strategy.end_step = counted_session, counted_end_step
    if check is not None:
        strategy.backward, strategy.optimizer_step = checked_backward, checked_optimizer_step
    return strategy


class ReservedCheck:
    """Whether a candidate's step so far already put it over the limit: where the caching allocator's model,
    replaying the step's event log so far (as `plan` replays the whole log, with the same cuBLAS workspace), has
    reserved so much that reserved memory plus the CUDA context exceeds `limit_bytes`, `look` raises `OverLimit`.
    The model's segments are never returned (`bench.measure.cuda_allocator`): the measured step's reserved peak,
    which starts from what is reserved at its start, is at least as large, so the candidate's judged memory is over
    the limit too.

    The log is replayed at the end of the first warm-up step, and at the other looks once the tracker's live bytes
    (which the allocated blocks hold at least) reach the limit, again only after they grew another `REPLAY_GROWTH`
    of it: a replay of a full-size log costs a tenth of a second or more."""

    REPLAY_GROWTH = 1 / 16

    def __init__(self, limit_bytes: int, context_bytes: int, capability: tuple[int, int] | None):
        self.limit_bytes, self.context_bytes = limit_bytes, context_bytes
        self.workspace = cublas_workspace(capability)
        self.replay_at_live_bytes = limit_bytes - context_bytes

    def look(self, step: int, when: str, always: bool = False) -> None:
        tracker = _event_tracker()
        if tracker is None or not (always or tracker.live_bytes >= self.replay_at_live_bytes):
            return
        self.replay_at_live_bytes = max(self.replay_at_live_bytes,
                                        tracker.live_bytes + int(self.limit_bytes * self.REPLAY_GROWTH))
        reserved = cuda_allocator.replay(list(tracker.events), self.workspace).stats.reserved_bytes
        if reserved + self.context_bytes > self.limit_bytes:
            raise OverLimit(reserved, step, when)


def _event_tracker() -> LiveTensorTracker | None:
    """The live-tensor tracker recording the running step's event log (a dispatch mode entered around the steps)."""
    return next((mode for mode in reversed(_get_current_dispatch_mode_stack())
                 if isinstance(mode, LiveTensorTracker) and mode.record_events), None)
