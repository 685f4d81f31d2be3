"""Measurement: step timing, memory trackers (CUDA statistics, the exact live-tensor count), the allocator model,
the environment and the fake-CUDA mode; it knows nothing of cases, runs or strategies."""
