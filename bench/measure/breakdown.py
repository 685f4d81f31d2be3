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
- `peak_batch_bytes`        the input batch and targets, and the model's buffers (BatchNorm statistics);
- `peak_communication_bytes` the buffers of sharded training's collectives, filed where PyTorch allocates them
                            (`bench.core.memory_categories.COMMUNICATION`, declared by the strategies): FSDP2's
                            flat all-gather output (`AllGather.allocate`) and reduce-scatter input and output
                            (`ReduceScatter.allocate`; the output becomes the sharded gradients, filed as gradients
                            once each is accumulated), DistributedDataParallel's gradient buckets (made in its
                            forward's bucket rebuild) and buffer broadcasts. FSDP2's unsharded parameters (each
                            parameter's own all-gather output, into which the flat buffer is copied) are weights:
                            `peak_params_bytes` is the sharded parameters plus the units' unsharded ones in flight.

Predict's categories (`PREDICTED_COLUMNS`, the predict table): the same tracker categories at the predicted peak,
with the logits apart. `CategorizedTracker` logs each storage's category in its event log, so that the CUDA
allocator model (`bench.measure.cuda_allocator.replay`) can say what its peak is made of, and files as `logits` the
storages of tensors whose last dimension is the output head's (the vocabulary): the head's output, its float32
copy, cross-entropy's log-softmax and their gradients.
"""

from __future__ import annotations

import torch

from bench.core.memory_categories import COMMUNICATION, MOE_DISPATCH, MOE_ROUTER
from bench.measure import memory

BREAKDOWN_COLUMNS = ("peak_params_bytes", "peak_grads_bytes", "peak_optimizer_bytes", "peak_activations_bytes",
                     "peak_temp_bytes", "peak_batch_bytes", "peak_communication_bytes")

# tracker category -> breakdown column
CATEGORY_COLUMN = {
    "params": "peak_params_bytes",
    "grads": "peak_grads_bytes",
    "optimizer_state": "peak_optimizer_bytes",
    "forward": "peak_activations_bytes",
    MOE_ROUTER: "peak_activations_bytes",
    MOE_DISPATCH: "peak_activations_bytes",
    "batch": "peak_batch_bytes",
    "buffers": "peak_batch_bytes",
    COMMUNICATION: "peak_communication_bytes",
}
TEMP_COLUMN = "peak_temp_bytes"  # backward, optimizer (scratch), setup, untracked


# predict's columns: tracker category -> column (communication: as in the breakdown above); the rest (batch,
# buffers, backward and optimizer temporaries, cuBLAS's workspaces, the allocator's unsplit blocks) is
# `predicted_other_bytes`
LOGITS = "logits"
PREDICTED_COLUMNS = {
    "params": "predicted_weights_bytes",
    "grads": "predicted_grads_bytes",
    "optimizer_state": "predicted_optimizer_state_bytes",
    "forward": "predicted_activations_bytes",
    MOE_ROUTER: "predicted_activations_bytes",
    MOE_DISPATCH: "predicted_activations_bytes",
    LOGITS: "predicted_logits_bytes",
    COMMUNICATION: "predicted_communication_bytes",
}
PREDICTED_OTHER_COLUMN = "predicted_other_bytes"

# parts of the activations that a workload files apart (`bench.core.memory_categories`), named in a prediction's
# message rather than in columns of their own: a mixture-of-experts layer's router outputs and dispatch buffers
ACTIVATION_PARTS = {MOE_DISPATCH: "MoE dispatch buffers", MOE_ROUTER: "MoE router outputs"}


def activation_parts(peak_by_category: dict[str, int]) -> str | None:
    """The named parts of the activations at a peak (`ACTIVATION_PARTS`), in bytes, as one clause of a message; None
    where the step has none."""
    parts = [f"{name} {peak_by_category[category]:,} B" for category, name in ACTIVATION_PARTS.items()
             if category in peak_by_category]
    return f"activations include {', '.join(parts)}" if parts else None


def predicted_columns(peak_by_category: dict[str, int]) -> dict[str, int]:
    """Bytes at a predicted peak by category as predict's columns (`PREDICTED_COLUMNS`, then the rest in
    `PREDICTED_OTHER_COLUMN`); they sum to the bytes of `peak_by_category`."""
    columns = dict.fromkeys([*PREDICTED_COLUMNS.values(), PREDICTED_OTHER_COLUMN], 0)
    for category, nbytes in peak_by_category.items():
        columns[PREDICTED_COLUMNS.get(category, PREDICTED_OTHER_COLUMN)] += nbytes
    return columns


class CategorizedTracker(memory.LiveTensorTracker):
    """The exact tracker whose event log also says each storage's category as it is filed and re-filed (a
    "category" event: `key`, and the category in `op`), and which files the logits under `LOGITS`.

    `logits_features`: the output head's output features (the vocabulary); a storage first seen in the forward or
    backward as a tensor of at least two dimensions whose last one is that size is filed as logits. None: no
    logits category (a model without a separable head)."""

    def __init__(self, *args, logits_features: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.logits_features = logits_features

    def _log_category(self, tensors) -> None:
        if not self.record_events:
            return
        for t in tensors:
            if isinstance(t, torch.Tensor):
                t = getattr(t, "_local_tensor", t)
                try:
                    info = self._storages.get(t.untyped_storage())
                except (RuntimeError, NotImplementedError):
                    continue
                if info is not None:
                    self.events.append(memory.MemoryEvent("category", info.key, stage=self.stage, op=info.category))

    def _register(self, t: torch.Tensor, category: str) -> None:
        if (self.logits_features and category in ("forward", "backward") and t.dim() >= 2
                and t.shape[-1] == self.logits_features):
            category = LOGITS
        keys = self._keys
        super()._register(t, category)
        if self._keys != keys and self.record_events:  # before its "alloc" event: the replay files it at once
            self.events.insert(len(self.events) - 1, memory.MemoryEvent("category", self._keys, stage=self.stage,
                                                                        op=category))

    def recategorize(self, tensors, category: str) -> None:
        tensors = list(tensors)
        super().recategorize(tensors, category)
        self._log_category(tensors)

    def relabel_live(self, categories, category: str) -> None:
        old = set(categories)
        keys = [info.key for info in self._storages.values() if info.category in old]
        super().relabel_live(old, category)
        if self.record_events:
            self.events.extend(memory.MemoryEvent("category", key, stage=self.stage, op=category) for key in keys)


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
