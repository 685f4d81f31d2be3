"""The fake-tensor engine of predict and fit: one tracked step on PyTorch's fake tensors (no arithmetic).

It lives in the runner's layer (`bench.run.fake_pass`), which counts the memory of a 16-bit case the CPU emulates
with it; its names are kept here for analysis and for the code that imported them from here.
"""

from __future__ import annotations

from bench.run.fake_pass import FakeSession, fake_memory_pass

__all__ = ["FakeSession", "fake_memory_pass"]
