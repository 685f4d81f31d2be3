"""Layer replay's proof traced beside the smaller traces (bench/analysis/proof_beside.py): a prediction whose proof
ran in the worker is the prediction whose proof ran here, byte for byte; the worker is only forked where it can use
CUDA; a worker's failure leaves the proof to this process. The predictions run in fresh processes: this one asked
torch about CUDA long ago (the suite's skip), so its own worker would be refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.analysis import proof_beside
from bench.core.job_environment import PROOF_BESIDE_VARIABLE

from .conftest import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

ROOT = Path(__file__).resolve().parents[1]
ONE_KIND = ("hf:llama-3.2-1b:seq_len=32:layers=6", "lora")  # traced at 3 and 4 layers, the proof at 5
# 6 checkpointed and 3 plain layers: traced at 3+2, 4+2 (here) and 3+3 (the worker), the proof at 5+4 (the worker);
# 26 layers traced, more than the 9 of the full trace, so the share is lifted
TWO_KINDS = ("hf:llama-3.2-1b:seq_len=32:layers=9", "lora+checkpoint:segments=3")

# a fresh process's prelude: each trace it sends to the worker (or runs here: None) listed in `sent`
COUNTED = """
import json, sys
from bench.analysis import proof_beside
sent = []
submit = proof_beside.submit
def counted(trace, count, plain, **options):
    future = submit(trace, count, plain, **options)
    sent.append(None if future is None else (count, plain))
    return future
proof_beside.submit = counted
"""
# predicts a case in a fresh process, the traces sent to the worker (or not) as the arguments say; prints what ran
SCRIPT = COUNTED + """
import torch
from bench.analysis import layer_replay, predict
from bench.run.case import Case

layer_replay.KINDS_MOST_TRACED_SHARE = 3
if sys.argv[3] == "asked":  # torch asked about CUDA before the worker is forked: the worker cannot use it
    torch.cuda.is_available()
if sys.argv[3] == "failing":  # the worker's trace raises: the proof is traced here
    import multiprocessing
    tracer = layer_replay.tracer
    def failing_in_the_worker(*arguments, **options):
        if multiprocessing.parent_process() is not None:
            raise RuntimeError("the worker failed")
        return tracer(*arguments, **options)
    layer_replay.tracer = failing_in_the_worker
# "direct": predict_cases alone, on a case whose data source is given (not read from the workload), as
# bench.analysis._predict_worker gets its cases from the membench API's JSON: predict_cases stands the worker by
if sys.argv[3] != "direct":
    proof_beside.stand_by(sys.argv[1])  # as the CLI's predict does, before the workload is read
(row,) = predict.predict_cases([Case(sys.argv[1], sys.argv[2], "train", 1, "cuda", data="text")])
print(json.dumps({"row": {k: v for k, v in row.items() if k.startswith("predicted_") or k == "message"},
                  "sent": sent, "standing": proof_beside._standing() is not None}))
"""


def _predicted(case: tuple[str, str], how: str, beside: bool = True) -> dict:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), PROOF_BESIDE_VARIABLE: "1" if beside else "0"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, *case, how], cwd=ROOT, env=environment, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def here() -> dict:
    return {case: _predicted(case, "plain", beside=False) for case in (ONE_KIND, TWO_KINDS)}


@pytest.mark.parametrize("case, sent, note", [
    (ONE_KIND, [[5, None]], "layer replay: traced at 3, 4 and 5 layers"),
    (TWO_KINDS, [[3, 3], [5, 4]], "layer replay: traced at 3+2, 4+2, 3+3, 5+4 checkpointed+plain layers"),
], ids=["one kind", "two kinds"])
def test_traces_made_in_the_worker_move_no_byte(here, case, sent, note):
    beside = _predicted(case, "plain")
    assert beside["standing"] and beside["sent"] == sent, beside
    assert not here[case]["standing"] and not any(here[case]["sent"])
    assert note in beside["row"]["message"], beside["row"]["message"]
    assert beside["row"] == here[case]["row"]


def test_no_worker_once_torch_was_asked_about_cuda(here):
    asked = _predicted(ONE_KIND, "asked")
    assert not asked["standing"] and asked["sent"] == [None]
    assert asked["row"] == here[ONE_KIND]["row"]


def test_predict_cases_called_alone_stands_its_worker_by_before_it_asks_torch_about_cuda(here):
    direct = _predicted(ONE_KIND, "direct")
    assert direct["standing"] and direct["sent"] == [[5, None]], direct
    assert direct["row"] == here[ONE_KIND]["row"]


# `fit --over seq_len --jobs 1` in a fresh process, the traces sent to the worker counted; prints what ran
FIT_SCRIPT = COUNTED + """
from bench.cli.main import main
status = main(sys.argv[1:])
print(json.dumps({"status": status, "sent": sent, "standing": proof_beside._standing() is not None}))
"""


def test_fit_over_seq_len_in_one_process_has_its_worker_beside(tmp_path):
    """With --jobs 1 fit predicts its probes in its own process: the worker stands by before the workload is read
    (as predict's), so each probe's proof is traced beside; every figure is the one traced without it (17.6 -> 10.9 s
    for qlora+checkpoint of llama-3.1-8b on an RTX 4090, timed by hand)."""
    import pandas as pd

    tables = {}
    for beside in (True, False):
        out = tmp_path / str(beside)
        environment = {**os.environ, "PYTHONPATH": str(ROOT), PROOF_BESIDE_VARIABLE: "1" if beside else "0"}
        done = subprocess.run([sys.executable, "-c", FIT_SCRIPT, "fit", "--workload", "hf:llama-3.2-1b:layers=6",
                               "--device", "cuda", "--budget", "5GiB", "--over", "seq_len", "--batch-size", "1",
                               "--strategies", "lora", "--jobs", "1", "--out", str(out)],
                              cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        ran = json.loads(done.stdout.strip().splitlines()[-1])
        assert ran["standing"] is beside and ran["sent"] and all((sent is not None) is beside for sent in ran["sent"])
        (table,) = out.glob("fit-*.csv")
        tables[beside] = pd.read_csv(table, comment="#").drop(columns=["time_per_sample_ms"])
    assert tables[True].equals(tables[False]), (tables[True].T, tables[False].T)


def test_a_failing_worker_leaves_the_proof_here(here):
    failing = _predicted(ONE_KIND, "failing")
    assert failing["sent"] == [[5, None]]
    assert failing["row"] == here[ONE_KIND]["row"]


def test_no_worker_without_a_second_core_or_when_switched_off(monkeypatch):
    monkeypatch.setattr("bench.run.preflight.available_cores", lambda: 1)
    assert not proof_beside.enabled()
    monkeypatch.setattr("bench.run.preflight.available_cores", lambda: 2)
    monkeypatch.setenv(PROOF_BESIDE_VARIABLE, "0")
    assert not proof_beside.enabled()


def test_a_trace_with_counters_is_never_sent():
    def trace(count, plain=None, repeat_warmup=False):
        return ("here", count, plain)

    trace.made_by, trace.arguments = None, None  # a plan's `prepare`: layer_replay.tracer sends nothing
    assert proof_beside.submit(trace, 5, None) is None
    assert proof_beside.result(None, trace, 5, 4) == ("here", 5, 4)
    assert proof_beside.result(None, trace, 5, None) == ("here", 5, None)
