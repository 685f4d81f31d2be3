"""Shared test set-up: a private data cache, and the `cuda` marker skipped on machines without a GPU."""

import os

import pytest
import torch


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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch.cuda.is_available() is False")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
