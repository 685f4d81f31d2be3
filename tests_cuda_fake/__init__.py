"""membench's CUDA code path on fake CUDA tensors (`make test-cuda-fake`); see conftest.py and fake_mode.py."""
