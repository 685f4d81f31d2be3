"""A dispatch mode that only passes each operator on while a tracker above it counts, taken off the mode stack for
that time: one Python call (and one trip through the dispatcher) less per operator of a traced step.

`bench.measure.fake_allocator.FakeAllocator` with `counted_by` is such a mode: while its tracker is entered, it
leaves every operator to that tracker (`func(*args)`), so removing it from the stack changes nothing but the cost
(a tenth of a fake-CUDA step's dispatch was that call). A mode says so by its `passes_through_while` attribute,
the tracker it defers to. The autograd engine's threads take the stack as it is when a backward starts, so they see
it without the mode too.
"""

from __future__ import annotations

from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode


def set_aside_below(tracker):
    """Called just after `tracker` entered: the mode right below it, taken off the stack where it passes every
    operator on while `tracker` counts (its `passes_through_while` is `tracker`); None where there is none."""
    stack = _get_current_dispatch_mode_stack()
    if len(stack) < 2 or stack[-1] is not tracker or getattr(stack[-2], "passes_through_while", None) is not tracker:
        return None
    _pop_mode()
    below = _pop_mode()
    _push_mode(tracker)
    return below


def put_back_below(tracker, below) -> None:
    """Called just before `tracker` exits: `below` (what `set_aside_below` returned) back under it."""
    if below is None:
        return
    stack = _get_current_dispatch_mode_stack()
    if not stack or stack[-1] is not tracker:
        raise RuntimeError("a dispatch mode left on top of a tracker that is exiting")
    _pop_mode()
    _push_mode(below)
    _push_mode(tracker)
