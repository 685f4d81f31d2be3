"""bench.measure.fake_cuda: where the fake-CUDA environment is, or why there is none (the environment itself is tested by
`make test-cuda-fake`)."""

from bench.measure import fake_cuda


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
