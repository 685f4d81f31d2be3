"""A membench installed by pip, outside the checkout, builds its own fake-CUDA environment (`python -m bench cuda-env`)
and predicts `--device cuda` on CUDA's own operators there: the package carries what that needs (every subpackage,
the stub builder, the data files), and nothing of the checkout is read (the copy it was installed from is deleted
before, and the commands run in an empty folder).

Slow (minutes: two environments, PyPI's CUDA build of torch, half a gigabyte) and in need of PyPI: skipped, saying
so, where PyPI cannot be reached.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PYPI_TORCH = "https://pypi.org/simple/torch/"  # where cuda-env takes the CUDA build of torch from
WORKLOAD = "hf:gpt2:layers=2"


def pypi_unreachable() -> str | None:
    """Why PyPI cannot be reached from here (None: it can)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(PYPI_TORCH, method="HEAD"), timeout=15):
            return None
    except OSError as error:
        return f"PyPI cannot be reached ({error}): the fake-CUDA environment's CUDA build of torch comes from there"


def copy_of_the_checkout(target: Path) -> Path:
    """The checkout's files as git sees them (tracked and new, not ignored: no .venv, results or caches) in `target`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout
    for name in filter(None, (os.fsdecode(n) for n in listed.split(b"\0"))):
        if (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    return target


def run(command: list, cwd: Path, env: dict, timeout_s: float) -> subprocess.CompletedProcess:
    done = subprocess.run([str(part) for part in command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.slow
def test_a_pip_installed_membench_builds_its_cuda_environment_and_predicts_cuda_outside_the_checkout(tmp_path):
    reason = pypi_unreachable()
    if reason:
        pytest.skip(reason)
    # nothing of this checkout or its environments: no PYTHONPATH, no membench variable
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("MEMBENCH_")}
    work = tmp_path / "work"
    work.mkdir()
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], work, env, 300)
    python = venv / "bin" / "python"
    # this environment's torch first (a CPU build), so that membench's `torch>=2.4` does not pull PyPI's CUDA one
    pinned = subprocess.run([python, "-m", "pip", "install", "--quiet", f"torch=={torch.__version__}"], cwd=work,
                            env=env, capture_output=True, text=True, timeout=1200)
    if pinned.returncode != 0:
        pytest.skip(f"torch=={torch.__version__} cannot be installed in a new environment here: "
                    f"{pinned.stderr.strip()[-300:]}")
    source = copy_of_the_checkout(tmp_path / "source")
    run([python, "-m", "pip", "install", "--quiet", f"{source}[hf]"], work, env, 1200)
    shutil.rmtree(source)

    located = run([python, "-c", "import bench, strategies, workloads; print(bench.__file__)"], work, env, 120)
    assert Path(located.stdout.strip()).is_relative_to(venv)

    built = run([python, "-m", "bench", "cuda-env"], work, env, 2400)
    cuda_venv = venv / "membench-cuda-env"  # the default beside a membench installed by pip
    assert str(cuda_venv) in built.stdout
    seen = run([cuda_venv / "bin" / "python", "-c",
                "import bench, torch; print(bench.__file__); print(torch.version.cuda, torch.cuda.device_count())"],
               work, env, 300).stdout.split()
    assert Path(seen[0]).is_relative_to(cuda_venv) and seen[1] != "None" and seen[2] == "1"

    predicted = run([python, "-m", "bench", "predict", "--device", "cuda", "--workload", WORKLOAD, "--out", work],
                    work, env, 1200)
    [table] = work.glob("predict-*.csv")
    with table.open() as rows_file:
        rows = list(csv.DictReader(rows_file))
    assert {row["phase"] for row in rows} == {"train", "eval"}, predicted.stdout
    for row in rows:
        assert row["status"] == "ok" and row["engine"] == "fake-cuda", row
        assert int(row["predicted_bytes"]) > 0
