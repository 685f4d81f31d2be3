"""membench's internal variable of the fake-CUDA worker, set by hand where torch has no CUDA: `import membench`
still works (the CLI refuses the variable in one line: tests/test_hostile_inputs_round5.py)."""

import os
import subprocess
import sys

import pytest
import torch

from cli_helpers import ROOT


@pytest.mark.skipif(torch.version.cuda is not None, reason="with a CUDA build the variable makes a fake-CUDA worker")
def test_import_membench_with_the_fake_cuda_workers_variable_set_by_hand(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import membench; print(membench.estimate.__name__)"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MEMBENCH_FAKE_CUDA_WORKER": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.strip() == "estimate", done.stderr[-2000:]
