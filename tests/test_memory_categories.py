"""What code that allocates tells the tracker (bench.core.memory_categories): storages made inside `allocating(c)` are
filed under `c`, tensors handed to `file_as` are re-filed, and only trackers entered now listen."""

from __future__ import annotations

import torch

from bench.core import memory_categories
from bench.core.memory_categories import COMMUNICATION, UNIFIED_MEMORY, allocating, file_as
from bench.measure import breakdown
from bench.measure.memory import LiveTensorTracker


def test_storages_made_inside_allocating_are_filed_under_its_category_and_add_up():
    tracker = LiveTensorTracker("cpu")
    with tracker:
        tracker.stage = "backward"
        with allocating(COMMUNICATION):
            flat = torch.empty(1000)  # 4,000 B: a collective's buffer
            view = flat[:10]  # a view makes no storage
        grad = torch.ones(250)  # 1,000 B: the stage's
        assert tracker.live_by_category[COMMUNICATION] == flat.untyped_storage().nbytes() == 4000
        assert tracker.live_by_category["backward"] == grad.untyped_storage().nbytes()
        file_as([view], "grads")  # the whole storage, once: re-filed, not counted twice
        assert tracker.live_by_category[COMMUNICATION] == 0 and tracker.live_by_category["grads"] == 4000
        columns = breakdown.breakdown_columns(tracker)
    # the peak (5,000 B) came while the buffer was still communication: re-filing later does not rewrite it
    assert columns["peak_communication_bytes"] == 4000 and columns["peak_temp_bytes"] == 1000
    assert sum(columns.values()) == tracker.peak_bytes == 5000
    assert not memory_categories.listening()  # the tracker stopped listening when it exited


def test_allocating_outside_any_tracker_changes_nothing():
    with allocating(COMMUNICATION):
        t = torch.zeros(4)
    file_as([t], "grads")
    tracker = LiveTensorTracker("cpu")
    with tracker:
        tracker.stage = "forward"
        torch.zeros(4)
        assert COMMUNICATION not in tracker.live_by_category


def test_allocating_for_some_dtypes_files_only_their_storages():
    """bitsandbytes pages a state's uint8 codes, not its float32 block scales: `allocating(c, dtypes)` files only the
    storages of tensors of those dtypes under `c`, the others as outside it (the stage's, or an enclosing category)."""
    tracker = LiveTensorTracker("cpu")
    with tracker:
        tracker.stage = "optimizer"
        with allocating(UNIFIED_MEMORY, dtypes=(torch.uint8,)):
            codes = torch.zeros(1000, dtype=torch.uint8)  # 1,000 B
            scales = torch.zeros(4)  # 16 B
        with allocating(COMMUNICATION), allocating(UNIFIED_MEMORY, dtypes=(torch.uint8,)):
            buffer = torch.zeros(8)  # 32 B: float32, so the enclosing category's
        assert tracker.live_by_category[UNIFIED_MEMORY] == codes.untyped_storage().nbytes() == 1000
        assert tracker.live_by_category["optimizer"] == scales.untyped_storage().nbytes() == 16
        assert tracker.live_by_category[COMMUNICATION] == buffer.untyped_storage().nbytes() == 32


def test_inside_one_fused_kernel_only_the_storages_updated_in_place_are_memory():
    """bitsandbytes' 8-bit update is one kernel, emulated with PyTorch's operators: its intermediates (here a float32
    copy and a product) are no storage to the trackers; what it updates in place stays counted once."""
    tracker = LiveTensorTracker("cpu")
    with tracker:
        tracker.stage = "optimizer"
        weight = torch.zeros(1000)  # 4,000 B
        with memory_categories.one_fused_kernel():
            update = weight.double() * 2  # 8,000 + 8,000 B of intermediates
            weight.add_(update.float())  # and 4,000 more
        assert tracker.live_bytes == tracker.peak_bytes == 4000
        later = weight * 2  # outside again: counted
        assert tracker.live_bytes == 8000 and later.untyped_storage().nbytes() == 4000
