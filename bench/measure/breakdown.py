"""What a peak is made of: the tracker's categories filed into the breakdown columns of a row.

Breakdown of the peak (CPU/meta tracker only; the columns add up to `peak_mem_bytes` exactly):

- `peak_params_bytes`       the model's parameters (registered before the step);
- `peak_grads_bytes`        storages that are some parameter's `.grad` (re-filed by a post-accumulate-grad hook
                            the moment they become `.grad`; a gradient that is still an op's output at the peak,
                            not yet accumulated, counts as a temporary);
- `peak_optimizer_bytes`    the optimizer's state (`optimizer.state` tensors) plus any other storage created in the
                            backward or optimizer stage of an earlier step that is still alive when the measured step
                            starts (state kept between steps, e.g. a GradScaler's scale);
- `peak_activations_bytes`  storages created in a forward stage and alive at the peak: tensors autograd saved for
                            backward, the forward's live intermediates, the step's output and loss, and the
                            previous step's output during the forward, until the loop rebinds it (with its graph,
                            when eval keeps autograd on);
- `peak_temp_bytes`         everything else: storages created in the backward or optimizer stage of this step that
                            are not gradients (input gradients, optimizer scratch), plus the few storages first seen
                            as an op's input (`untracked`) or created between steps (`setup`);
- `peak_batch_bytes`        the input batch and targets, and the model's buffers (BatchNorm statistics).
"""

from __future__ import annotations

import torch

from bench.measure import memory

BREAKDOWN_COLUMNS = ("peak_params_bytes", "peak_grads_bytes", "peak_optimizer_bytes", "peak_activations_bytes",
                     "peak_temp_bytes", "peak_batch_bytes")

# tracker category -> breakdown column
CATEGORY_COLUMN = {
    "params": "peak_params_bytes",
    "grads": "peak_grads_bytes",
    "optimizer_state": "peak_optimizer_bytes",
    "forward": "peak_activations_bytes",
    "batch": "peak_batch_bytes",
    "buffers": "peak_batch_bytes",
}
TEMP_COLUMN = "peak_temp_bytes"  # backward, optimizer (scratch), setup, untracked


def prepare_breakdown(session, tracker: memory.LiveTensorTracker) -> list:
    """Called after the warm-up steps, before the measured one: files state and gradients for the breakdown.

    Returns the hook handles to remove after the step. `session.watch_grads` sees each gradient before a strategy
    that steps in backward frees it, so that the gradients alive at the peak count as gradients there too.
    """
    tracker.recategorize(session.optimizer_state(), "optimizer_state")
    tracker.relabel_live(("backward", "optimizer"), "optimizer_state")  # other state kept between steps
    params = [p for p in session.parameters() if p.requires_grad]
    tracker.recategorize([p.grad for p in params], "grads")  # gradients kept between steps (zero_grad to 0)

    def as_grad(param: torch.Tensor) -> None:
        tracker.recategorize([param.grad], "grads")

    return [session.watch_grads(as_grad)]


def breakdown_columns(tracker: memory.LiveTensorTracker) -> dict[str, int]:
    """The tracker's categories at the peak as the breakdown columns; they sum to `tracker.peak_bytes`."""
    columns = dict.fromkeys(BREAKDOWN_COLUMNS, 0)
    for category, nbytes in tracker.peak_by_category.items():
        columns[CATEGORY_COLUMN.get(category, TEMP_COLUMN)] += nbytes
    assert sum(columns.values()) == tracker.peak_bytes, (columns, tracker.peak_bytes)
    return columns
