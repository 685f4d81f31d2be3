"""Set-up shared by every test tree (tests/, tests_cuda_fake/, benchmarks/): a private data cache."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_data_cache(tmp_path_factory):
    """Generated captchas go to a temporary cache, so tests never depend on (or fill) the user's."""
    old = os.environ.get("MEMBENCH_CACHE")
    os.environ["MEMBENCH_CACHE"] = str(tmp_path_factory.mktemp("membench-cache"))
    yield
    if old is None:
        os.environ.pop("MEMBENCH_CACHE", None)
    else:
        os.environ["MEMBENCH_CACHE"] = old
