"""The example in examples/ loads, trains and runs as its docstring says a user would run it."""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workloads.framework.loader import resolve_workload

ROOT = Path(__file__).resolve().parent.parent
SPEC = "examples/my_workload.py:MyWorkload"


@pytest.fixture(autouse=True)
def _from_the_root(monkeypatch, one_thread):
    """The spec is a path relative to the checkout's root, as in the example's docstring."""
    monkeypatch.chdir(ROOT)


def test_the_example_loads_with_its_options():
    workload = resolve_workload(SPEC)
    assert workload.spec() == SPEC and workload.settings["width"] == 32
    small = resolve_workload(f"{SPEC}:width=8:blocks=2")
    assert small.spec() == f"{SPEC}:width=8:blocks=2" and small.settings["blocks"] == 2


def test_the_example_trains():
    workload = resolve_workload(f"{SPEC}:width=8")
    model = workload.build_model().train()
    images, labels = workload.make_batch(4, "synthetic")
    assert images.shape == (4, 3, 32, 32) and labels.shape == (4,)
    loss = workload.loss(workload.run_model(model, images).float(), labels)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    workload.make_optimizer(model).step()


def test_the_examples_checkpoint_units_chain_to_its_output():
    workload = resolve_workload(f"{SPEC}:width=8")
    model = workload.build_model().eval()
    units = workload.checkpoint_units(model)
    assert len(units) == workload.settings["blocks"] + 2 and workload.units_chain  # stem, blocks, head
    images, _ = workload.make_batch(2)
    with torch.no_grad():
        y = images
        for unit in units:
            y = unit(y)
        torch.testing.assert_close(y, model(images), rtol=0, atol=0)


def test_the_command_in_the_examples_docstring_runs(tmp_path):
    source = (ROOT / "examples" / "my_workload.py").read_text()
    command = next(line.strip() for line in source.splitlines() if line.strip().startswith("python -m bench compare"))
    # the documented command, at a small width, batch and training only (a later --workload replaces the first), its
    # cases in this one process: workers of their own would each import torch again, and isolation has its own tests
    argv = shlex.split(command)[1:] + ["--workload", f"{SPEC}:width=8", "--batch-size", "8", "--phases", "train",
                                       "--no-isolate", "--threads", "1", "--out", str(tmp_path)]
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert any(tmp_path.glob("*.csv"))  # the results file
    checkpoint_rows = [line for line in done.stdout.splitlines() if line.startswith("checkpoint ")]
    assert checkpoint_rows and all(line.split()[-1] == "ok" for line in checkpoint_rows), done.stdout
