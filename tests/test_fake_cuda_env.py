"""bench.measure.fake_cuda: where the fake-CUDA environment is, or why there is none; `cuda-env`'s refusals (the
environment itself is tested by `make test-cuda-fake`, its build by a pip-installed membench by
test_installed_cuda_env.py)."""

import pytest

from bench.measure import cuda_env, fake_cuda
from cli_helpers import main_in_process, one_line_exit_2


def built(venv):
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / fake_cuda.INSTALLED_STAMP).write_text("")
    return venv


def test_a_built_environment_gives_its_python(tmp_path):
    venv = built(tmp_path / "venv")
    assert fake_cuda.environment_python(venv) == venv / "bin" / "python"
    assert fake_cuda.unavailable_reason(venv) is None


def test_no_environment_says_how_to_build_it(tmp_path):
    assert fake_cuda.environment_python(tmp_path / "venv") is None
    assert "make cuda-fake-env" in fake_cuda.unavailable_reason(tmp_path / "venv")


def test_a_failed_build_gives_its_reason(tmp_path):
    venv = built(tmp_path / "venv")
    (venv / fake_cuda.UNAVAILABLE_FILE).write_text("no cc on this machine (the stubs are compiled at set-up)\n")
    assert fake_cuda.environment_python(venv) is None
    assert fake_cuda.unavailable_reason(venv).endswith("no cc on this machine (the stubs are compiled at set-up)")


def test_an_incomplete_environment_is_not_used(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert fake_cuda.environment_python(venv) is None
    assert "incomplete" in fake_cuda.unavailable_reason(venv)


def test_the_worker_environment_adds_the_shim_once_and_keeps_other_plugins():
    env = fake_cuda.worker_environment({"MEMBENCH_PLUGINS": "my.plugin"})
    assert env["MEMBENCH_PLUGINS"] == f"my.plugin,{fake_cuda.WORKER_PLUGIN}"
    assert env[fake_cuda.WORKER_FLAG] == "1"
    assert fake_cuda.worker_environment(env)["MEMBENCH_PLUGINS"] == env["MEMBENCH_PLUGINS"]
    assert str(fake_cuda.ROOT) in env["PYTHONPATH"]


def test_an_installed_membench_keeps_its_own_folder_off_the_environment_path(monkeypatch):
    """Installed by pip, membench's folder is its environment's site-packages, whose CPU torch would shadow the CUDA
    build there: the fake-CUDA environment has its own copy of membench instead."""
    monkeypatch.setattr(fake_cuda, "IN_CHECKOUT", False)
    env = fake_cuda.worker_environment({"PYTHONPATH": "/mine"})
    assert env["PYTHONPATH"] == "/mine" and env[fake_cuda.WORKER_FLAG] == "1"
    assert "PYTHONPATH" not in fake_cuda.python_environment({})


@pytest.mark.parametrize("make_path, named", [
    (lambda tmp: tmp / "a-file", "is a file"),
    (lambda tmp: tmp, "not a virtual environment"),
])
def test_cuda_env_refuses_a_path_it_cannot_build_in(tmp_path, make_path, named):
    (tmp_path / "a-file").write_text("mine\n")
    path = make_path(tmp_path)
    done = main_in_process("cuda-env", "--path", path, "--torch-version", "2.13.0")
    one_line_exit_2(done, "--path", str(path), named)
    assert (tmp_path / "a-file").read_text() == "mine\n" and not (tmp_path / "bin").exists()


@pytest.mark.parametrize("option", ["--torch-version", "--torchvision-version"])
def test_cuda_env_refuses_a_version_that_is_no_release_number(tmp_path, option):
    done = main_in_process("cuda-env", "--path", tmp_path / "env", option, "latest")
    one_line_exit_2(done, option, "'latest'", "2.13.0")
    assert not (tmp_path / "env").exists()


def test_a_checkout_is_not_copied_into_the_environment_as_if_pip_had_installed_it(tmp_path):
    """This checkout runs from its folder (installed editable in .venv, its metadata an egg-info): only files pip
    installed (its RECORD) are copied, those of the membench running, never a checkout's tree."""
    with pytest.raises(cuda_env.Unavailable, match="editable install, or a checkout"):
        cuda_env.copy_installed_membench(tmp_path)
    assert not any(tmp_path.iterdir())
