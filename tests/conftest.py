"""`slow` tests (minutes on a 2-core CPU) run only with --runslow or MEMBENCH_SLOW=1."""

import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow") or os.environ.get("MEMBENCH_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow or MEMBENCH_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
