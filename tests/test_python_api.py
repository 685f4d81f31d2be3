"""membench's Python API (the `membench` package): each figure equals the command line's for the same workload, the
user's inputs fail with one error naming them, and the Trainer callback writes a run that `report --html` draws."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

import membench
from bench.cli.main import main
from bench.core.snapshots import replay_peaks
from membench.measuring import BREAKDOWN

ROOT = Path(__file__).resolve().parent.parent
SPEC = "examples/python_api.py:workload"
FAKE_CUDA_PYTHON = ROOT / ".venv-cuda-fake" / "bin" / "python"


@pytest.fixture
def example(monkeypatch, one_thread):
    """examples/python_api.py imported as a module, from the checkout's root (its workload spec is relative)."""
    monkeypatch.chdir(ROOT)
    spec = importlib.util.spec_from_file_location("python_api_example", ROOT / "examples" / "python_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _table(folder: Path, prefix: str = "") -> pd.DataFrame:
    (path,) = [p for p in folder.glob(f"{prefix}*.csv") if not p.name.endswith(".timeline.csv")]
    return pd.read_csv(path)


# --- errors in the user's inputs --------------------------------------------------------------------------------
def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


BATCH = (torch.randn(4, 8), torch.randint(3, (4,)))


@pytest.mark.parametrize("inputs, named", [
    (dict(batch=(torch.randn(4, 5), BATCH[1])), "batch: the model rejects it"),
    (dict(loss_fn=lambda output, target: output), "loss_fn: returned (4, 3), not a scalar"),
    (dict(optimizer=lambda params: torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)),
     "optimizer: 2 of its parameters are not the model's"),
    (dict(batch=(torch.randn(4, 8),)), "batch: expected (inputs, target)"),
    (dict(model=torch.optim.SGD), "model: the build function failed"),
])
def test_a_bad_input_is_one_error_naming_it(inputs, named):
    given = {**dict(model=_mlp, batch=BATCH, loss_fn=torch.nn.functional.cross_entropy, optimizer=None), **inputs}
    with pytest.raises(membench.InputError) as raised:
        membench.estimate(given.pop("model"), name="bad_input", **given)
    assert str(raised.value).startswith(named) and "\n" not in str(raised.value)
    error = raised.value  # no deep traceback chained to it
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)


def test_measure_refuses_an_optimizer_over_another_model():
    other = torch.optim.Adam(_mlp().parameters())
    with pytest.raises(membench.InputError, match="^optimizer: 4 of its parameters are not the model's"):
        membench.measure(_mlp(), other)


def test_a_workload_redefined_under_its_name_is_the_new_one():
    """A notebook cell run again with another batch: the spec's cached batch and figures are the new ones."""
    loss = torch.nn.functional.cross_entropy
    small = membench.estimate(_mlp, (torch.randn(4, 8), torch.randint(3, (4,))), loss, name="cell")
    large = membench.estimate(_mlp, (torch.randn(64, 8), torch.randint(3, (64,))), loss, name="cell")
    assert (small.batch_size, large.batch_size) == (4, 64) and large.allocated_bytes > small.allocated_bytes
    assert small.workload == large.workload == "membench.workload:cell"


def test_a_workload_redefined_under_its_name_is_read_afresh():
    """Its traits (what the strategies' expectations key on) are those of the new model, not the cached ones."""
    from workloads import get_workload

    def with_batch_norm():
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                   torch.nn.Linear(8, 3))

    traits = []
    for model in (_mlp, with_batch_norm):
        estimate = membench.estimate(model, BATCH, torch.nn.functional.cross_entropy, name="cell_traits")
        traits.append(get_workload(estimate.workload).traits())
    assert "batch_norm" not in traits[0] and "batch_norm" in traits[1]


def test_a_gpu_estimate_of_an_inline_model_says_how_it_was_predicted():
    """Without the fake-CUDA environment (or for a workload no other process can rebuild) the CUDA estimate runs
    here on the CPU's operators, and says so; `fits` judges reserved bytes plus the CUDA context."""
    e = membench.estimate(_mlp, BATCH, torch.nn.functional.cross_entropy, gpu="RTX 4090", name="inline_gpu")
    assert (e.device, e.gpu, e.engine, e.status) == ("cuda", "RTX 4090", "fake", "ok")
    assert "in this process only" in e.message
    assert e.reserved_bytes >= e.allocated_bytes > 0 and e.peak_bytes == e.reserved_bytes
    assert e.fits("RTX 4090") and e.fits(e.reserved_bytes) and not e.fits(e.reserved_bytes - 1)
    assert not e.fits(e.reserved_bytes, headroom=0.5)


# --- equal to the command line's figures ----------------------------------------------------------------------
def test_a_cpu_estimate_equals_predict(example, tmp_path):
    estimate = membench.estimate(example.workload(), device="cpu")
    assert main(["predict", "--workload", SPEC, "--device", "cpu", "--batch-size", str(example.BATCH),
                 "--out", str(tmp_path)]) == 0
    row = _table(tmp_path, "predict-").iloc[0]
    assert estimate.status == "ok" and estimate.allocated_bytes == row["predicted_bytes"] > 0
    for name, column in membench.estimating.BREAKDOWN.items():
        assert estimate.breakdown[name] == row[column], name
    assert estimate.fits(estimate.allocated_bytes) and not estimate.fits(estimate.allocated_bytes - 1)


def test_measure_of_the_users_loop_equals_compares_memory_pass(example, tmp_path):
    """The example's own loop (three real CPU steps) against `compare`'s baseline row for the same workload: the
    steady-state steps (2 and 3; membench's memory pass measures the step after one warm-up) equal it to the byte,
    breakdown included. The inline workload (no file) runs through compare too, with the same figure."""
    measured = example.measured_steps()
    assert len(measured.steps) == 3
    argv = ["compare", "--strategies", "baseline", "--device", "cpu", "--steps", "1", "--warmup", "0",
            "--phases", "train", "--batch-size", str(example.BATCH)]
    assert main([*argv, "--workload", SPEC, "--out", str(tmp_path / "file")]) == 0
    row = _table(tmp_path / "file").iloc[0]
    for step in measured.steps[1:]:
        assert step.peak_bytes == row["peak_mem_bytes"] and step.peak_stage == row["peak_stage"]
        assert step.columns() == {**step.columns(), **{c: row[c] for c in BREAKDOWN.values()}}
    assert measured.steps[0].peak_bytes < row["peak_mem_bytes"]  # no optimizer state before the first step
    inline = membench.workload_from_callables(example.TinyTransformer, example.make_batch(), example.loss_fn,
                                              example.optimizer, name="tiny_inline")
    assert main([*argv, "--workload", inline.spec(), "--out", str(tmp_path / "inline")]) == 0
    assert _table(tmp_path / "inline").iloc[0]["peak_mem_bytes"] == row["peak_mem_bytes"]


def test_fit_returns_the_rows_fit_writes(tmp_path, one_thread):
    """fit on inline callables (the workload as `membench.workload:NAME`, which the command resolves in this
    process) gives the rows `fit` writes for it."""
    rows = membench.fit(_mlp, BATCH, torch.nn.functional.cross_entropy, budget="40KiB", max_batch=512, name="fit_mlp")
    assert main(["fit", "--workload", "membench.workload:fit_mlp", "--budget", "40KiB", "--max-batch", "512",
                 "--time-steps", "0", "--device", "cpu", "--out", str(tmp_path)]) == 0
    cli = _table(tmp_path, "fit-").to_dict("records")
    keys = ("strategy", "batch_size", "peak_bytes", "verified", "next_batch_peak_bytes")
    assert [[r[k] for k in keys] for r in rows] == [[r[k] for k in keys] for r in cli]
    assert 1 < rows[0]["batch_size"] < 512 and rows[0]["peak_bytes"] <= 40 * 1024 < rows[0]["next_batch_peak_bytes"]


def test_measure_writes_a_snapshot_per_step_whose_peak_is_the_steps(tmp_path):
    torch.manual_seed(0)
    model, (x, y) = _mlp(), BATCH
    opt = torch.optim.Adam(model.parameters())
    with membench.measure(model, opt, batch=(x, y), snapshot_dir=tmp_path, name="mlp") as m:
        for _ in range(2):
            with m.step():
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
    assert [s.snapshot.exists() for s in m.steps] == [True, True]
    for step in m.steps:
        snapshot = pd.read_pickle(step.snapshot)
        assert replay_peaks(snapshot)[0] == step.peak_bytes
    assert torch.autograd.backward.__module__ == "torch.autograd"  # the stage hook is gone with the measurement


@pytest.mark.cuda
def test_measure_on_a_gpu_equals_compares_cuda_memory_pass(example, tmp_path):
    """On CUDA a step's peak is max_memory_allocated; compare's memory pass measures the step after two warm-up
    steps (MEMORY_WARMUP_STEPS["cuda"]), the example loop's third. Not run where this was written (no GPU)."""
    torch.manual_seed(0)
    model = example.TinyTransformer().cuda()
    opt = example.optimizer(model.parameters())
    x, y = (t.cuda() for t in example.make_batch())
    with membench.measure(model, opt, batch=(x, y)) as m:
        for _ in range(3):
            with m.step():
                pred = model(x)
                loss = example.loss_fn(pred, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
    assert main(["compare", "--workload", SPEC, "--strategies", "baseline", "--device", "cuda", "--steps", "1",
                 "--warmup", "0", "--phases", "train", "--batch-size", str(example.BATCH),
                 "--out", str(tmp_path)]) == 0
    row = _table(tmp_path).iloc[0]
    assert m.steps[2].peak_bytes == row["peak_mem_bytes"] and m.steps[2].reserved_bytes is not None


@pytest.mark.slow  # 42 s on the loaded 2-core machine: three processes of the fake-CUDA environment's torch
@pytest.mark.skipif(not (ROOT / ".venv-cuda-fake" / ".installed").exists(), reason="no fake-CUDA environment")
def test_gpu_estimates_and_plan_equal_the_cli_on_fake_cuda(tmp_path):
    """In the fake-CUDA environment (CUDA's own operators on fake tensors), the example's estimates for an RTX 4090
    and an H100 and its plan equal `predict --device cuda --capability` and `plan --gpu` to the byte."""
    script = f"""
import importlib.util, json, sys, glob
import pandas as pd
from bench.cli.main import main
spec = importlib.util.spec_from_file_location("example", "examples/python_api.py")
example = importlib.util.module_from_spec(spec); spec.loader.exec_module(example)
out = {{"api": {{gpu: e.row for gpu, e in example.estimates().items()}}, "cli": {{}}}}
for gpu, cap in (("RTX 4090", "8.9"), ("H100", "9.0")):
    assert main(["predict", "--workload", "{SPEC}", "--device", "cuda", "--capability", cap,
                 "--out", "{tmp_path}/" + cap]) == 0
    out["cli"][gpu] = pd.read_csv(glob.glob("{tmp_path}/" + cap + "/predict-*.csv")[0]).iloc[0].to_dict()
plan = example.planned()
assert main(["plan", "--workload", "{SPEC}", "--gpu", "RTX 4090", "--max-candidates", "4", "--jobs", "1",
             "--out", "{tmp_path}/plan"]) == 0
cli_plan = pd.read_csv(glob.glob("{tmp_path}/plan/plan-*.csv")[0])
number = lambda b: None if b is None or pd.isna(b) else int(b)
out["plan"] = [plan.strategy, sorted((r["strategy"], number(r["judged_bytes"])) for r in plan.rows)]
out["cli_plan"] = [cli_plan[cli_plan["answer"] == True]["strategy"].iloc[0],
                   sorted((s, number(b)) for s, b in zip(cli_plan["strategy"], cli_plan["judged_bytes"]))]
print("JSON" + json.dumps(out, default=str))
"""
    done = subprocess.run([str(FAKE_CUDA_PYTHON), "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.split("JSON", 1)[1])
    for gpu in ("RTX 4090", "H100"):
        api, cli = out["api"][gpu], out["cli"][gpu]
        assert api["engine"] == cli["engine"] == "fake-cuda"
        for column in ("predicted_bytes", "predicted_reserved_bytes", *membench.estimating.BREAKDOWN.values()):
            assert int(api[column]) == int(cli[column]), (gpu, column)
    assert out["api"]["H100"]["predicted_bytes"] != out["api"]["RTX 4090"]["predicted_bytes"]  # cuBLAS workspace
    assert out["plan"][0] == out["cli_plan"][0]
    assert out["plan"][1] == out["cli_plan"][1] and len(out["plan"][1]) >= 2


# --- the Hugging Face Trainer callback ----------------------------------------------------------------------------
def _trainer_run(spec: str, batch: int, out: Path):
    """Two steps of a transformers Trainer on the CPU over the workload's own model and token rows (labels = the
    inputs: transformers shifts them), recorded by MembenchCallback; the Trainer set as membench's loop where that is
    a choice: the workload's own optimizer (torch's AdamW, one parameter group, as `compare` builds it; the
    Trainer's default would be fused AdamW over two groups), no gradient clipping (max_grad_norm=0)."""
    from membench.hf import MembenchCallback
    from transformers import Trainer, TrainingArguments
    from workloads import get_workload

    workload = get_workload(spec)
    torch.manual_seed(workload.seed)
    model = workload.build_model()
    rows = workload.make_batch(batch, workload.data_sources[0])[0]["input_ids"].tolist()  # no tensor held here

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, index):
            return {"input_ids": rows[index % batch], "labels": rows[index % batch]}

    callback = MembenchCallback(out, workload=spec)
    args = TrainingArguments(str(out / "trainer"), max_steps=2, per_device_train_batch_size=batch, max_grad_norm=0.0,
                             report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0)
    Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[callback],
            optimizers=(workload.make_optimizer(model), None)).train()
    return callback


# What the Trainer's own loop holds beyond membench's, each alive at the peak of the step (transformers 5,
# accelerate 1): accelerate's DataLoaderShard reads one batch ahead, so the next batch (input_ids and labels,
# 8 bytes a token each) lives through the step; and 4-byte scalars: the Trainer's running loss `_tr_loss`, the step's
# `num_items_in_batch` (counted before the step), the gradient norm (clip_grad_norm_ with an infinite bound,
# computed even without clipping, alive until the next step's norm); in a step after the first, also the previous
# step's loss (`tr_loss_step`, until training_step returns) and accelerate's `loss / gradient_accumulation_steps`
# (a new scalar even at 1) that the backward runs from.
TRAINER_SCALARS = {1: 3, 2: 5}


def _compare_row(spec: str, strategies: str, batch: int, out: Path) -> pd.DataFrame:
    assert main(["compare", "--workload", spec, "--strategies", strategies, "--device", "cpu", "--steps", "1",
                 "--warmup", "0", "--phases", "train", "--batch-size", str(batch), "--out", str(out)]) == 0
    return _table(out).set_index("strategy")


def _check_trainer_against_compare(spec: str, batch: int, seq_len: int, vocab: int, tmp_path: Path,
                                   loss: str = "model") -> None:
    """Each step the callback records against `compare` on the same configuration: the workload with
    `loss=model` (the model's own loss from `labels=`, as the Trainer computes it). Its steady-state step (the one
    `compare` measures, after one warm-up step on the CPU) equals the Trainer's second step, and the same engine with
    no warm-up step (`memory_pass(..., warmup_steps=0)`) its first, to the byte, in every storage the model, the
    loss, the optimizer and the batch hold, in each column of the breakdown and in the stage of the peak; the only
    bytes apart are the Trainer loop's own (TRAINER_SCALARS: the next batch and a few scalars), which the
    assertions name column by column. `compare`'s baseline equals `del_intermediates` there: the loop's kept
    output is the loss, freed when the next forward returns, before the backward peak. The default loop
    (`loss=logits`) holds the logits, batch x tokens x vocabulary x 4 bytes, through the backward as well."""
    from bench.run.case import Case, bind_case
    from bench.run.passes import memory_pass

    callback = _trainer_run(spec, batch, tmp_path / "trainer_results")
    same = f"{spec}:loss={loss}"
    rows = _compare_row(same, "baseline,del_intermediates", batch, tmp_path / "compare")
    default = _compare_row(spec, "baseline", batch, tmp_path / "compare_default").loc["baseline"]
    case = Case(same, "baseline", "train", batch, "cpu")
    cold = memory_pass(case, bind_case(case)[0], warmup_steps=0)
    tokens = batch * seq_len
    next_batch = 2 * tokens * 8
    row = rows.loc["baseline"]
    assert row["peak_mem_bytes"] == rows.loc["del_intermediates", "peak_mem_bytes"]
    # the columns the Trainer's own storages fall in: in the steady step the scalars made in a forward (the previous
    # loss, accelerate's loss / 1) as activations, those made after the last step's backward (its gradient norm, this
    # step's num_items_in_batch) as state kept between steps, the next batch and `_tr_loss` (made before tracking
    # began) as temp; in the first step, whose peak is in the optimizer, its three scalars and the next batch as temp
    extra = {2: {"params": 0, "grads": 0, "optimizer": 8, "activations": 8, "temp": next_batch + 4, "batch": 0,
                 "communication": 0},
             1: {"params": 0, "grads": 0, "optimizer": 0, "activations": 0, "temp": next_batch + 12, "batch": 0,
                 "communication": 0}}
    for step, expected in ((callback.steps[0], cold), (callback.steps[1], row)):
        n = step.index + 1
        assert step.peak_stage == expected["peak_stage"], n
        assert step.peak_bytes == expected["peak_mem_bytes"] + next_batch + 4 * TRAINER_SCALARS[n], n
        for name, column in BREAKDOWN.items():
            assert step.breakdown[name] == expected[column] + extra[n][name], (n, name)
    assert default["peak_mem_bytes"] - row["peak_mem_bytes"] == tokens * vocab * 4  # the default loop's kept logits
    written = _table(callback.results_dir)
    assert list(written["strategy"]) == ["trainer:step1", "trainer:step2"]
    assert list(written["peak_mem_bytes"]) == [s.peak_bytes for s in callback.steps]
    assert main(["report", "--results", str(callback.results_dir), "--html"]) == 0
    html = next(callback.results_dir.glob("*.REPORT.html")).read_text()
    assert "trainer:step2" in html and spec in html


def test_the_trainer_callback_records_a_run_report_draws(tmp_path, one_thread):
    """A tiny GPT-2 (from a configuration file): fast, the same relation as the slow test below."""
    config = tmp_path / "tiny_gpt2.json"
    config.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 96, "n_embd": 32, "n_layer": 2, "n_head": 2,
                                  "n_positions": 64}))
    _check_trainer_against_compare(f"hf:{config}:seq_len=8", 2, 8, 96, tmp_path)


@pytest.mark.slow  # GPT-2's 50,257-token embedding: about a minute of Trainer and compare on 2 cores
def test_the_trainer_callback_on_gpt2_two_layers(tmp_path, one_thread):
    _check_trainer_against_compare("hf:gpt2:layers=2:seq_len=16", 2, 16, 50257, tmp_path)


def test_membench_sits_on_top_nothing_below_imports_it():
    """The API is the top layer (beside bench.cli): no module of bench/, strategies/ or workloads/ imports it, and each
    of its modules says on its first line what it is for."""
    import ast

    for top in ("bench", "strategies", "workloads"):
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                assert not any(n.split(".")[0] == "membench" for n in names), path
    for path in (ROOT / "membench").glob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert text.startswith('"""') and len(text.splitlines()[0]) > 10 and len(text.splitlines()) < 400, path
