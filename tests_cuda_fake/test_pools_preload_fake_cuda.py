"""A search's fork server (bench.analysis.pools.start_server) imports what each worker's first candidate would
import, and nothing that asks torch about CUDA devices: its workers start with transformers and torch._dynamo
imported, and can still use CUDA (a child forked from a process that counted the devices cannot)."""

import subprocess
import sys

import pytest

from tests_cuda_fake.conftest import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

# in a fresh interpreter: the fork server is one per process, and this one may have started it with other modules
SCRIPT = """
from bench.analysis import pools
pool = pools.local(2, "bench.analysis.plan_search", {workload!r})
imported = pool.submit(eval, "sorted(__import__('sys').modules.keys() & {{'transformers', 'torch._dynamo'}})")
cuda = pool.submit(eval, "__import__('torch').cuda.init() or __import__('torch').cuda.is_initialized()")
print(imported.result(), cuda.result())
pool.shutdown()
"""


def _worker_state(workload: str) -> str:
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(workload=workload)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_an_hf_search_forks_workers_with_transformers_imported_that_can_use_cuda():
    assert _worker_state("hf:llama-3.2-1b") == "['torch._dynamo', 'transformers'] True"


def test_another_search_forks_workers_without_transformers():
    assert _worker_state("captcha_resnet18") == "['torch._dynamo'] True"
