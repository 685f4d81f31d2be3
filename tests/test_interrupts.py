"""Ctrl-C: the run stops with exit code 130 and says which file holds what was done and the exact command that
finishes it, or that nothing was written. The CLI runs as a real process, interrupted by a real SIGINT.
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest


from bench.core import results
from cli_helpers import ROOT


def _ctrl_c_as_in_a_terminal() -> None:
    """In the child before it execs: SIGINT's default action. A shell runs a background job (`make test &`, CI
    under nohup) with SIGINT ignored, which children inherit, and Python then installs no KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt_after_first_row(args, out: Path) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, "-m", "bench", *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "MEMBENCH_TEST_SLOW": "1"},
                            preexec_fn=_ctrl_c_as_in_a_terminal)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        found = [p for p in out.glob("*.csv")] if out.is_dir() else []
        if found and len(results.read_results(found[0])) >= 1:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)


SLOW_AT_BATCH_2 = textwrap.dedent('''
    """A workload whose steps take a tenth of a second at batch 2 while $MEMBENCH_TEST_SLOW is set."""
    import os
    import time

    import torch
    from torch import nn

    from workloads import Workload


    class Slow(nn.Linear):
        def forward(self, x):
            if x.shape[0] >= 2 and os.environ.get("MEMBENCH_TEST_SLOW"):
                time.sleep(0.1)
            return super().forward(x)


    class SlowWorkload(Workload):
        name = "slow"
        description = "slow at batch 2"
        default_batch_size = 1

        def build_model(self):
            torch.manual_seed(self.seed)
            return nn.Sequential(Slow(4, 4), nn.Linear(4, 4))

        def make_batch(self, batch_size, data="synthetic"):
            gen = torch.Generator().manual_seed(self.seed)
            return torch.randn(batch_size, 4, generator=gen), torch.randn(batch_size, 4, generator=gen)

        def loss(self, output, target):
            return nn.functional.mse_loss(output, target)
''')


@pytest.mark.slow  # in .ci/run's long tests of make test
def test_an_interrupt_names_the_file_and_the_exact_resume_command(tmp_path):
    """Ctrl-C during the second case (a slow one): the message names the CSV holding the first and the command
    that finishes the run; that command, run as printed, does."""
    workload = tmp_path / "slow.py"
    workload.write_text(SLOW_AT_BATCH_2)
    out = tmp_path / "out"
    args = ["compare", "--strategies", "baseline", "--workload", f"{workload}:SlowWorkload", "--phases", "eval",
            "--batch-size", "1,2", "--device", "cpu", "--warmup", "0", "--steps", "3000", "--threads", "1",
            "--no-isolate", "--out", out]
    done = _interrupt_after_first_row(args, out)
    assert done.returncode == 130, done.stderr[-2000:]
    csv = next(out.glob("*.csv"))
    assert str(csv) in done.stderr
    command = re.search(r"^\s+(\S*python\S* -m bench .*--resume .*)$", done.stderr, re.M).group(1)
    assert command.endswith(f"--resume {csv}")
    resumed = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env={k: v for k, v in os.environ.items() if k != "MEMBENCH_TEST_SLOW"})
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert sorted(results.read_results(csv)["batch_size"]) == [1, 2]


def test_an_interrupt_without_a_file_says_nothing_was_written(tmp_path):
    # steps of a model large enough that 10,000 of them (the limit) take long past the first "timing" line
    proc = subprocess.Popen([sys.executable, "-m", "bench", "fit", "--budget", "1GiB", "--workload",
                             "deep_mlp:layers=16:width=256", "--max-batch", "64", "--time-steps", "10000",
                             "--out", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_ctrl_c_as_in_a_terminal)
    deadline = time.monotonic() + 120
    seen = ""
    while time.monotonic() < deadline and "timing" not in seen:
        seen += proc.stderr.readline()
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert "nothing was written" in stderr and "CSV" not in stderr
    assert not list(tmp_path.glob("*.csv"))

