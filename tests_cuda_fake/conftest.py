"""The fake-CUDA tests run only in the environment `make cuda-fake-env` builds (anywhere else they skip, saying why),
each on one torch thread and with fewer memory-pass steps."""

import pytest
import torch

from bench.measure import fake_cuda
from bench.measure.fake_cuda_mode import is_fake_device


def unavailable_reason() -> str | None:
    """Why this Python cannot run the fake-CUDA tests (None: it can)."""
    if torch.version.cuda is None:
        return fake_cuda.unavailable_reason() or (
            f"torch {torch.__version__} here is a build without CUDA: `make test-cuda-fake` runs these tests in the "
            f"fake-CUDA environment ({fake_cuda.VENV.name})")
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device: the stub CUDA libraries are missing (make cuda-fake-env)"
    if not is_fake_device():
        return f"a real GPU ({torch.cuda.get_device_name(0)}): the fake-CUDA tests are for machines without one"
    return None


@pytest.fixture(autouse=True)
def _one_thread():
    """torch on one thread (two test processes share two cores), restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _fewer_memory_steps(monkeypatch):
    """The memory pass with one warm-up step before the measured one instead of CUDA's two, and none after it:
    each fake step costs a second or more, the second warm-up step is there for cuDNN's autotuning and the
    allocator, which fake tensors do not have, and the steps after it measure growth, which is not asserted here.
    The same code runs, with fewer iterations."""
    from bench.run import runner

    monkeypatch.setitem(runner.MEMORY_WARMUP_STEPS, "cuda", 1)
    monkeypatch.setattr(runner, "MEMORY_GROWTH_STEPS", 0)


def pytest_collection_modifyitems(config, items):
    reason = unavailable_reason()
    if reason:
        for item in items:
            item.add_marker(pytest.mark.skip(reason=reason))


