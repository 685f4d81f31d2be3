"""How a plan candidate's step is traced (`bench.analysis.plan.evaluate`): its operators counted in the measured step
only, and a step stopped once the candidate certainly cannot fit.

Both change no figure of a candidate that runs to the end: the counter's list of the measured step is the one it
made when it also counted the warm-up steps (whose lists were thrown away), and a candidate is stopped only on a
bound that its judged memory cannot go under (tests/test_plan_step.py runs each candidate both ways).
"""

from __future__ import annotations

import contextlib
from typing import Callable

from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from bench.core.schema import Row
from bench.core.results import Status
from bench.analysis.fake_engine import cublas_workspace
from bench.measure import cuda_allocator
from bench.measure.memory import LiveTensorTracker
from bench.measure.op_cost import OperatorCostCounter

# what the message of a candidate stopped once over the limit begins with (its peak and time are not predicted)
STOPPED_OVER_LIMIT = "does not fit (stopped early)"


class MeasuredStepCounter(OperatorCostCounter):
    """The operator counter of a candidate's step that counts only while `armed` (its measured step, the last): the
    warm-up steps' operators were counted and thrown away (the row reads the last step's), and counting costs a
    tenth or more of a full-size trace. Unarmed it calls each operator as the counter does, and records nothing."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.armed:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class OverLimit(Exception):
    """A candidate's step stopped once it certainly does not fit: the caching allocator's model had reserved
    `reserved_bytes` at the end of warm-up step `step`."""

    def __init__(self, reserved_bytes: int, step: int):
        super().__init__(f"{reserved_bytes} B reserved after warm-up step {step}")
        self.reserved_bytes, self.step = reserved_bytes, step


def stopped_over_limit(row: Row) -> bool:
    """Whether `row` is a candidate stopped once it certainly did not fit (`plan.evaluate`'s `may_stop`)."""
    return row["status"] == Status.OK.value and row["judged_bytes"] is None \
        and (row["message"] or "").startswith(STOPPED_OVER_LIMIT)


def counted(strategy, counter: OperatorCostCounter, warmup_steps: int | None = None,
            over_limit: Callable[[int], None] | None = None):
    """`strategy` with `counter` entered around its session and told where each step ends. With `warmup_steps` (a
    `MeasuredStepCounter`) the counter is armed for the step after them, the measured one; `over_limit(step)` runs
    at the end of the first warm-up step (`reserved_check`: it raises `OverLimit` where the candidate cannot fit)."""
    session, end_step = strategy.session, strategy.end_step
    ended = [0]

    @contextlib.contextmanager
    def counted_session():
        with session(), counter:
            yield

    def counted_end_step(kept):
        end_step(kept)
        counter.end_step()
        ended[0] += 1
        if warmup_steps:
            counter.armed = ended[0] == warmup_steps
            if over_limit is not None and ended[0] == 1:
                over_limit(ended[0])

    strategy.session, strategy.end_step = counted_session, counted_end_step
    return strategy


def _event_tracker() -> LiveTensorTracker | None:
    """The live-tensor tracker recording the running step's event log (a dispatch mode entered around the steps)."""
    return next((mode for mode in reversed(_get_current_dispatch_mode_stack())
                 if isinstance(mode, LiveTensorTracker) and mode.record_events), None)


def reserved_check(limit_bytes: int, context_bytes: int, capability: tuple[int, int] | None) -> Callable[[int], None]:
    """A check that raises `OverLimit` where the caching allocator's model, replaying the step's event log so far
    (as `plan` replays the whole log, with the same cuBLAS workspace), has reserved so much that reserved memory
    plus the CUDA context exceeds `limit_bytes`. Its segments are never returned (`bench.measure.cuda_allocator`):
    the reserved peak of the measured step, which starts from what is reserved at its start, is at least as large,
    so the candidate's judged memory is over the limit too."""
    workspace = cublas_workspace(capability)

    def check(step: int) -> None:
        tracker = _event_tracker()
        if tracker is None:
            return
        reserved = cuda_allocator.replay(list(tracker.events), workspace).stats.reserved_bytes
        if reserved + context_bytes > limit_bytes:
            raise OverLimit(reserved, step)
    return check
