"""When `python -m bench` hands a whole command to the fake-CUDA environment's Python (bench.cli.fake_cuda_handover):
only a CUDA predict/fit/plan whose work would go there anyway, decided from its arguments before torch is imported,
never twice; and the exec keeps the command line, the working directory and the exit status.

The rows it gives are the worker path's to the byte: tests_cuda_fake/test_predict_fake_cuda.py runs both."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.cli import fake_cuda_handover
from bench.cli.main import build_parser
from bench.measure import fake_cuda

FAKE_PYTHON = Path("/opt/fake-cuda/bin/python")


@pytest.fixture
def environment_built(monkeypatch):
    """A fake-CUDA environment that exists, and a torch here built without CUDA."""
    monkeypatch.setattr(fake_cuda, "environment_python", lambda venv=None: FAKE_PYTHON)
    monkeypatch.setattr(fake_cuda_handover, "torch_build", lambda: "cpu")
    monkeypatch.delenv(fake_cuda_handover.HANDED_OVER_VARIABLE, raising=False)


def handed_to(*argv: str) -> Path | None:
    return fake_cuda_handover.handover_python(build_parser().parse_args(list(argv)))


@pytest.mark.parametrize("argv", [
    ("predict",), ("predict", "--device", "cuda", "--strategies", "amp"), ("predict", "--gpu", "RTX 4090"),
    ("predict", "--engine", "fake-cuda"), ("fit", "--gpu", "RTX 4090", "--over", "seq_len"),
    ("fit", "--device", "cuda", "--budget", "4GiB"), ("plan", "--gpu", "H100"),
    ("plan", "--gpu", "H100", "--executor", "local", "--max-ranks", "8"),
])
def test_a_cuda_prediction_is_handed_over(environment_built, argv):
    assert handed_to(*argv) == FAKE_PYTHON


@pytest.mark.parametrize("argv", [
    ("predict", "--device", "cpu"), ("predict", "--engine", "fake"), ("predict", "--config", "trainer.yaml"),
    ("fit", "--budget", "4GiB"), ("fit", "--gpu", "RTX 4090", "--memory-limit", "0.5"),
    ("plan", "--budget", "4GiB"), ("plan", "--gpu", "H100", "--confirm"),
    ("plan", "--gpu", "H100", "--executor", "ray"),
    ("plan", "--list-gpus"), ("run",), ("explain", "--strategy", "amp"), ("report", "results"),
])
def test_a_command_that_needs_this_python_stays(environment_built, argv):
    assert handed_to(*argv) is None


def test_never_handed_over_twice_nor_without_the_environment_nor_from_a_cuda_torch(environment_built, monkeypatch):
    monkeypatch.setenv(fake_cuda_handover.HANDED_OVER_VARIABLE, sys.executable)
    assert handed_to("predict") is None  # the handed-over process itself: no exec loop
    monkeypatch.delenv(fake_cuda_handover.HANDED_OVER_VARIABLE)
    monkeypatch.setattr(fake_cuda_handover, "torch_build", lambda: "gpu")
    assert handed_to("predict") is None  # a CUDA torch decides for itself (a GPU, or that environment)
    monkeypatch.setattr(fake_cuda_handover, "torch_build", lambda: None)
    assert handed_to("predict") is None  # unknown: stay
    monkeypatch.setattr(fake_cuda_handover, "torch_build", lambda: "cpu")
    monkeypatch.setattr(fake_cuda, "environment_python", lambda venv=None: None)
    assert handed_to("predict") is None  # not built: the CPU's operators here, as before


@pytest.mark.parametrize("text, build", [
    ("__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\nhip: Optional[str] = None\n", "cpu"),
    ("__version__ = '2.13.0+cu130'\ncuda: Optional[str] = '13.0'\nhip: Optional[str] = None\n", "gpu"),
    ("__version__ = '2.13.0+rocm6.4'\ncuda = None\nhip = '6.4.0'\n", "gpu"),
    ("__version__ = '2.13.0'\n", None),
])
def test_the_torch_build_is_read_without_importing_torch(tmp_path, monkeypatch, text, build):
    package = tmp_path / "torch"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('importing torch is what this avoids')\n")
    (package / "version.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert fake_cuda_handover.torch_build() == build


def test_this_torch_is_read_as_the_build_it_is():
    import torch

    assert fake_cuda_handover.torch_build() == ("cpu" if torch.version.cuda is None and torch.version.hip is None
                                                else "gpu")


def test_the_handed_over_process_keeps_the_command_line_folder_and_exit_status(tmp_path, monkeypatch):
    """hand_over execs `python -m bench ARGV` in the same process: here a stand-in `python` that records what it got
    and exits 3, which is what the caller of the original process sees."""
    record = tmp_path / "got.txt"
    stand_in = tmp_path / "python"
    stand_in.write_text(f"#!/bin/sh\necho \"$PWD|$*|${fake_cuda_handover.HANDED_OVER_VARIABLE}\" > {record}\nexit 3\n")
    stand_in.chmod(0o755)
    code = ("import sys; from pathlib import Path; from bench.cli import fake_cuda_handover as h; "
            f"h.hand_over(Path({str(stand_in)!r}), ['predict', '--out', 'rel dir']); sys.exit(0)")
    root = Path(__file__).resolve().parent.parent
    env = {**fake_cuda.python_environment(), "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, timeout=60)
    assert done.returncode == 3
    folder, argv, handed_from = record.read_text().strip().split("|")
    assert folder == str(tmp_path) and argv == "-m bench predict --out rel dir" and handed_from == sys.executable


def test_a_python_that_cannot_be_executed_leaves_the_command_here(tmp_path):
    missing = tmp_path / "no-python"
    assert fake_cuda_handover.hand_over(missing, ["predict"]) is None  # returned: the command runs in this process


def test_the_handed_over_process_imports_the_plugins_as_the_worker_did(tmp_path, monkeypatch):
    (tmp_path / "membench_handover_plugin.py").write_text("import builtins\nbuiltins.handover_plugin_imported = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("MEMBENCH_PLUGINS", "membench_handover_plugin")
    import builtins

    monkeypatch.setattr(fake_cuda, "environment_python", lambda venv=None: Path(sys.prefix) / "bin" / "python")
    monkeypatch.delenv(fake_cuda_handover.HANDED_OVER_VARIABLE, raising=False)
    fake_cuda_handover.import_plugins_on_arrival()  # not handed over: the CLI leaves plugins to its workers
    assert not hasattr(builtins, "handover_plugin_imported")
    monkeypatch.setenv(fake_cuda_handover.HANDED_OVER_VARIABLE, "/some/python")
    try:
        fake_cuda_handover.import_plugins_on_arrival()
        assert builtins.handover_plugin_imported
    finally:
        monkeypatch.delitem(sys.modules, "membench_handover_plugin", raising=False)
        if hasattr(builtins, "handover_plugin_imported"):
            del builtins.handover_plugin_imported


def test_the_fake_cuda_python_holds_pytorchs_cpp_log_to_errors_unless_asked():
    """The fake process group's ranks make ProcessGroup's C++ warn that no backend registered hooks: noise on the
    user's terminal that says nothing of the prediction; a TORCH_CPP_LOG_LEVEL the user set is kept."""
    assert fake_cuda.python_environment({})["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    assert fake_cuda.python_environment({"TORCH_CPP_LOG_LEVEL": "INFO"})["TORCH_CPP_LOG_LEVEL"] == "INFO"
