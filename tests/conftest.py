"""Shared test set-up: `cuda` tests skipped without a GPU; `slow` ones only on request (the private data cache: ../conftest.py)."""

import gc
import os

import pytest
import torch

from strategies import STRATEGIES


@pytest.fixture
def temporary_strategy():
    """Registers throw-away strategies and removes them afterwards."""
    added = []

    def register(cls):
        STRATEGIES.register(cls)
        added.append(cls.name)
        return cls

    yield register
    for name in added:
        STRATEGIES.unregister(name)


@pytest.fixture(autouse=True)
def without_fake_cuda_environment(monkeypatch, tmp_path_factory):
    """`make test` is the same whether or not `make cuda-fake-env` has built .venv-cuda-fake/ in this checkout:
    the fake-CUDA environment is looked for in an empty folder, so predict does not hand its CUDA cases to it
    (tests_cuda_fake/ tests that route); a test that wants another answer patches `bench.measure.fake_cuda` again."""
    from bench.measure import fake_cuda

    monkeypatch.setattr(fake_cuda, "VENV", tmp_path_factory.getbasetemp() / "no-fake-cuda-environment")


@pytest.fixture
def one_thread():
    """torch on one thread for the test (small models run no faster on more), restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


# `make test` runs the tests in processes of pytest-xdist with --dist loadgroup: each file's tests go to one process
# together (its module-scoped fixtures and cached runs are built once), except the files named here, whose hundreds
# of cases share nothing and are spread across the processes one test at a time (test_workloads.py's grid is 40% of
# the suite's time: as one unit, collected last, it would run alone in one process at the end; test_one_file_cnn.py
# runs that grid on one more workload, whose registration each process makes for itself).
SPREAD_FILES = {"test_workloads.py", "test_one_file_cnn.py"}


def pytest_xdist_make_scheduler(config, log):
    """The grouping above, by file, as pytest-xdist's scheduler (under --dist loadgroup). Not by `xdist_group` marks:
    xdist 3.8 files a test under its mark by rewriting `item._nodeid`, which pytest 9 no longer reads (it keeps the
    node id in `_id`), so every test was its own group and each module-scoped fixture was built in both processes."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return nodeid if file.rsplit("/", 1)[-1] in SPREAD_FILES else file

    return ByFile(config, log)


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU; torch.cuda.is_available() is False")
    skip_slow = pytest.mark.skip(reason="slow: run with --runslow or MEMBENCH_SLOW=1")
    run_slow = config.getoption("--runslow") or os.environ.get("MEMBENCH_SLOW") == "1"
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)


def pytest_configure(config):
    """In a process of pytest-xdist, torch gets its share of the cores: each of 2 processes on 2 cores running torch's
    default of 2 threads oversubscribed them (test_analysis.py: 83 s in one process, 682 s in two)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_finish(session):
    """What the collected modules imported (torch, transformers, the registries: some 200,000 objects, alive until the
    session ends) is frozen out of the cyclic garbage collector: the harness collects garbage around each case
    (`bench.measure.resident.release_host_memory`, three times a case), and each full collection walked all of it
    again, 0.09 s of CPU and 0.8-1.4 s of wall time at a load average of 7. Everything a test makes after this is
    collected as before."""
    _freeze_what_is_alive()


def _freeze_what_is_alive():
    gc.collect()
    gc.freeze()


def pytest_runtest_teardown(item, nextitem):
    """After each test, its garbage collected and what it left alive frozen like the imports above: the modules a
    test imports lazily (torch._dynamo, inductor, transformers' models, timm) and the caches it fills are as
    long-lived as the collection's imports, and the full collections of the harness around each case (three a case)
    walked them all again, 0.22 s each at 240,000 objects: a third of test_workloads.py's and test_strategies.py's
    time on a slow 2-core machine. One collection here walks only what the test made."""
    _freeze_what_is_alive()
