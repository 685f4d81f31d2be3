"""`predict --device cuda` from the CPU environment, where it keeps to the worker path (`--config`, `--confirm`, ...;
forced here with MEMBENCH_FAKE_CUDA_HANDED_OVER, since a plain predict now becomes the fake-CUDA environment's Python
itself), hands its cases to a worker in the fake-CUDA environment's Python, whose request lives in a temporary
folder: SIGINT, SIGTERM and SIGHUP to the command end that worker and remove the folder (SIGTERM left both behind).
tests/test_signals.py has the CPU commands' cases, which are also the handed-over command's (one process)."""

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from bench.cli.fake_cuda_handover import HANDED_OVER_VARIABLE

ROOT = Path(__file__).resolve().parents[1]
CPU_PYTHON = ROOT / ".venv" / "bin" / "python"  # the environment whose predict hands CUDA cases to this one

# the CPU tests' workload whose every forward sleeps $MEMBENCH_TEST_SLEEP_S (tests/fixtures/sleepy_workload.py)
SLEEPY = (ROOT / "tests" / "fixtures" / "sleepy_workload.py").read_text()


def _signals_as_in_a_terminal() -> None:
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: signal.Signals(s).name)
def test_predict_on_fake_cuda_ends_its_worker_and_removes_its_folder(tmp_path, signum):
    if not CPU_PYTHON.exists():
        pytest.skip(f"no CPU environment at {CPU_PYTHON} (make install) to hand its CUDA cases to this one")
    workload = tmp_path / "sleepy.py"
    workload.write_text(SLEEPY)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {**os.environ, "TMPDIR": str(temporary), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "TRITON_CACHE_DIR": str(tmp_path / "triton"), "MEMBENCH_TEST_SLEEP_S": "30",
           HANDED_OVER_VARIABLE: "1"}  # the worker path: this command is not handed over whole
    env.pop("PYTHONPATH", None)
    proc = subprocess.Popen([str(CPU_PYTHON), "-m", "bench", "predict", "--device", "cuda", "--workload",
                             f"{workload}:SleepyWorkload", "--phases", "train", "--out", str(tmp_path / "out")],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_signals_as_in_a_terminal)
    children = []
    try:
        seen, deadline = "", time.monotonic() + 180
        while "on fake CUDA" not in seen and time.monotonic() < deadline and proc.poll() is None:
            seen += proc.stderr.readline()
        assert "on fake CUDA" in seen, f"predict did not hand its cases to the fake-CUDA worker: {seen[-2000:]}"
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children and any(p.name.startswith("membench-fake-cuda-") for p in temporary.iterdir())
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
        _, alive = psutil.wait_procs(children, timeout=15)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], "the worker outlived the command"
        assert proc.returncode == 128 + signum, stderr[-2000:]
        assert sorted(p.name for p in temporary.iterdir()) == []
    finally:  # a failed test leaves nothing running either
        for child in children:
            if child.is_running():
                child.kill()
        if proc.poll() is None:
            proc.kill()
