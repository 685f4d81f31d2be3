"""Sweeps on Ray: a local Ray on the CPU gives the same rows as the in-process runner, and a dead worker is a row; a
plan's candidates and a fit's probes as Ray tasks give what the serial search gives."""

from __future__ import annotations

import dataclasses

import pytest

from bench.analysis import fit as fitting
from bench.analysis import plan, plan_search
from bench.cli.main import main
from bench.run.isolation import RunOptions
from bench.run.case import Case
from bench.run.runner import local_executor, run_cases

ray = pytest.importorskip("ray")

from bench.run.ray_executor import RayExecutor, runtime_env  # noqa: E402 - only with ray installed


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for this module's tests (the executor leaves a Ray it did not start running): a new one
    (address "local"), never a cluster that $RAY_ADDRESS or another session's `ray start` names."""
    ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False,
             runtime_env=runtime_env(remote=False))
    yield
    ray.shutdown()


def _cases(*specs: str) -> list[Case]:
    # training only: each case on Ray is a worker process that imports torch, and the executor has no path of its
    # own for an eval case (the in-process runner's eval rows are tested beside its training rows)
    return [Case(workload, strategy, "train", 4, "cpu", data="synthetic", warmup=0, steps=1)
            for workload in specs for strategy in ("baseline", "checkpoint")]


# The tests that start a Ray cluster run in CI's slow step (.ci/run), not in `make test`: the local cluster's start and
# a fresh worker importing torch per case took about a minute of `make test`'s 2 cores
@pytest.mark.slow
def test_a_ray_sweep_finds_the_same_rows_as_the_in_process_runner(local_ray, tmp_path):
    cases = _cases("deep_mlp:layers=24:width=8")  # each case on Ray is a worker's start: two show the equality
    options = RunOptions(threads=1)
    here = run_cases(cases, tmp_path / "here.csv", options=options, executor=local_executor)
    on_ray = run_cases(cases, tmp_path / "ray.csv", options=RunOptions(threads=1, isolate=True, executor="ray"),
                       executor=RayExecutor())
    key = ("workload", "strategy", "phase", "batch_size", "status", "matches_baseline", "peak_mem_bytes",
           "peak_activations_bytes", "strategy_settings")
    assert [tuple(r[k] for k in key) for r in on_ray] == [tuple(r[k] for k in key) for r in here]
    assert {r["executor"] for r in on_ray} == {"ray"} and all(r["isolated"] for r in on_ray)
    assert all(r["host_name"] for r in on_ray)


KILLER = '''
import os
import signal

import torch
from torch import nn
from workloads import Workload


class Killer(Workload):
    """Dies with SIGKILL while building its model when `die` is set: a worker lost to the OOM killer."""
    options = {"die": False}

    def build_model(self):
        if self.settings["die"]:
            os.kill(os.getpid(), signal.SIGKILL)
        return nn.Linear(4, 2)

    def make_batch(self, batch_size, data="synthetic"):
        return torch.ones(batch_size, 4), torch.zeros(batch_size, 2)

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)
'''


@pytest.mark.slow
def test_a_killed_worker_is_an_error_row_and_the_sweep_goes_on(local_ray, tmp_path, monkeypatch):
    (tmp_path / "killer.py").write_text(KILLER)
    monkeypatch.chdir(tmp_path)  # the spec is relative to here; the Ray workers get the file's source
    cases = [Case("killer.py:Killer:die=true", "baseline", "train", 2, "cpu", warmup=0, steps=1),
             Case("killer.py:Killer", "baseline", "train", 2, "cpu", warmup=0, steps=1),
             Case("deep_mlp:layers=4:width=4", "baseline", "train", 2, "cpu", data="synthetic", warmup=0, steps=1)]
    rows = run_cases(cases, tmp_path / "run.csv", options=RunOptions(threads=1, executor="ray"),
                     executor=RayExecutor())
    assert [r["status"] for r in rows] == ["error", "ok", "ok"], rows
    assert "Ray task failed" in rows[0]["message"] and rows[0]["workload"] == "killer.py:Killer:die=true"


@pytest.mark.parametrize("args, words", [
    (["--executor", "spark"], ["'spark'", "local, ray"]),
    (["--ray-address", "auto"], ["--ray-address needs --executor ray"]),
])
def test_bad_executor_options_are_one_line_errors(args, words, capsys):
    assert main(["compare", "--strategies", "baseline", "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err


@pytest.mark.slow  # about a minute on 2 loaded cores: 4 candidates, each a fresh Ray worker importing torch
def test_a_plan_on_ray_finds_the_rows_and_answer_of_the_serial_search(local_ray, monkeypatch):
    """Each candidate a task in a fresh Ray worker: the same candidates, figures and answer as in this process."""
    from test_plan import TINY, _few_settings, _request

    _few_settings(monkeypatch, ("checkpoint", "amp"))
    request = _request(workload=TINY, batch_size=256)
    serial = plan_search.search(request)
    on_ray = plan_search.search(dataclasses.replace(request, jobs=0), executor="ray")
    assert on_ray.stopped is None and on_ray.jobs == 2  # the local cluster's CPUs
    figures = {r["strategy"]: (r["status"], r["judged_bytes"], r["est_step_time_ms"]) for r in serial.rows}
    assert figures == {r["strategy"]: (r["status"], r["judged_bytes"], r["est_step_time_ms"]) for r in on_ray.rows}
    assert "checkpoint+amp" in figures and on_ray.rows[0]["strategy"] == "baseline"
    limit = sorted(r["judged_bytes"] for r in serial.rows if r["judged_bytes"])[1]  # the second smallest fits
    answers = [plan.decide([{**r, "fits": r["judged_bytes"] is not None and r["judged_bytes"] <= limit}
                            for r in rows], False)["strategy"] for rows in (serial.rows, on_ray.rows)]
    assert answers[0] == answers[1]


MLP = '''
import torch
from torch import nn
from workloads import Workload


class Mlp(Workload):
    """Two linear layers: a user's workload file, which the Ray workers get as its source."""

    def build_model(self):
        return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    def make_batch(self, batch_size, data="synthetic"):
        return torch.ones(batch_size, 16), torch.zeros(batch_size, 4)

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)
'''


@pytest.mark.slow  # tens of seconds on 2 loaded cores: each probe a fresh Ray worker importing torch
def test_a_fit_with_its_probes_on_ray_gives_the_serial_fits_row(local_ray, tmp_path, monkeypatch):
    """Fake-tensor probes as Ray tasks, the tracked run here: the serial fit's batch, peak and next batch's row, for
    a workload given as file.py:NAME (its source travels to the workers, which run elsewhere)."""
    (tmp_path / "mlp.py").write_text(MLP)
    monkeypatch.chdir(tmp_path)
    workload = "mlp.py:Mlp"
    budget = fitting._probe_peak(fitting.Case(workload, "baseline", "train", 40, "cpu", data="synthetic", warmup=0,
                                              steps=1), "baseline")
    [serial] = fitting.fit([], budget, "train", "cpu", workload, "synthetic", 4096, time_steps=0)
    [on_ray] = fitting.fit([], budget, "train", "cpu", workload, "synthetic", 4096, time_steps=0, jobs=0,
                           executor="ray")
    assert serial.batch_size == on_ray.batch_size == 40
    assert dataclasses.asdict(on_ray) == dataclasses.asdict(serial)
