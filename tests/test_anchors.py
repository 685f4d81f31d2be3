"""The anchors (bench/anchors/*.yaml) and `python -m bench anchors`: every file parses into rows that say their
source, figure, kind and configuration; a row's error; a strategy membench lacks becomes a visible not-modelled
row; nvidia-smi's terms. No full-size prediction runs here: the predictor is replaced where a row would predict."""

from __future__ import annotations

import subprocess

import pandas as pd
import pytest

from bench.analysis import anchors, nvidia_smi
from bench.cli.main import main
from bench.core.gpus import CUDA_CONTEXT_BYTES, find_gpu
from bench.core.results import ANCHORS
from bench.core.units import MiB
from workloads.framework.hf_presets import PRESETS

ALL = anchors.load_anchors()


def test_the_sources_give_at_least_fifteen_rows():
    assert {a.source for a in ALL} == {"torchtune", "torchao", "transformers", "fsdp_qlora", "torchtitan",
                                    "colossalai_lightning"}
    assert len(ALL) >= 15
    assert len({a.name for a in ALL}) == len(ALL), "anchor names are unique (--only selects by them)"


@pytest.mark.parametrize("anchor", ALL, ids=[a.name for a in ALL])
def test_every_anchor_names_its_source_figure_kind_configuration_and_gpu(anchor):
    assert "@" in anchor.source_ref and len(anchor.source_ref.rsplit("@", 1)[1]) == 40  # repository/path@commit
    assert anchor.figure > 0 and anchor.unit in anchors.UNITS and anchor.kind in anchors.KINDS
    assert anchor.configuration and anchor.label
    assert find_gpu(anchor.gpu).capability >= (7, 0)
    # the model: a config.json of bench/anchors/models/, or a membench preset of published configuration numbers
    assert anchor.workload().startswith("hf:")
    assert (anchors.MODEL_DIR / f"{anchor.model}.json").is_file() or anchor.model in PRESETS
    assert anchor.assumptions, "what the source leaves unstated is written down"


def test_published_bytes_follow_the_unit():
    by_name = {a.name: a for a in ALL}
    assert by_name["transformers-vanilla"].published_bytes == 14949 * MiB  # print_gpu_utilization: used // 1024**2
    assert by_name["torchtune-packed"].published_bytes == 60 * 2**30


def test_error_arithmetic():
    assert anchors.error_of(110, 100) == (10, 10.0)
    assert anchors.error_of(90, 100) == (-10, -10.0)
    assert anchors.error_of(None, 100) == (None, None)


def _anchor(**changes) -> anchors.Anchor:
    values = dict(name="tiny", source="test", source_ref="a/b/c@" + "0" * 40, label="tiny", figure=1.0, unit="GiB",
                  kind="max_memory_allocated", gpu="V100", model="llama-3.2-3b", strategy="baseline",
                  configuration={"model": "tiny"}, assumptions=["none"])
    values.update(changes)
    return anchors.Anchor(**values)


def _predict_row(allocated=2**30 + 2**20, reserved=2**30 + 20 * 2**20):
    return {"status": "ok", "predicted_bytes": allocated, "predicted_reserved_bytes": reserved, "engine": "fake-cuda",
            "sdpa_kernel": "flash", "message": ""}


def test_an_unknown_strategy_is_a_visible_not_modelled_row_and_nothing_is_predicted():
    def predictor(*_):
        raise AssertionError("a spec that does not parse is never predicted")

    row = anchors.anchor_row(_anchor(strategy="no_such_technique+checkpoint"), predictor)
    assert row["status"] == "not_modelled" and row["predicted_bytes"] is None and row["error_pct"] is None
    assert "no_such_technique" in row["not_modelled"] and "unknown strategy" in row["not_modelled"]
    assert row["fully_modelled"] is False


def test_a_fallback_is_predicted_as_partial_with_the_missing_technique_named():
    seen = {}

    def predictor(case, ranks, capability):
        seen.update(case=case, capability=capability)
        return _predict_row(), ""

    row = anchors.anchor_row(_anchor(strategy="checkpoint:no_such_option=all", fallback="checkpoint"), predictor)
    assert seen["case"]["strategy"] == "checkpoint" and seen["capability"] == (7, 0)  # the anchor's GPU: a V100
    assert row["status"] == "partial" and row["predicted_spec"] == "checkpoint"
    assert "checkpoint:no_such_option=all" in row["not_modelled"] and not row["fully_modelled"]
    assert row["predicted_bytes"] == 2**30 + 2**20 and row["error_bytes"] == 2**20
    assert row["error_pct"] == pytest.approx(100 * 2**20 / 2**30)


def test_each_kind_is_predicted_by_the_figure_of_that_kind():
    row = anchors.anchor_row(_anchor(kind="max_memory_reserved"), lambda *_: (_predict_row(), ""))
    assert row["predicted_bytes"] == 2**30 + 20 * 2**20 and row["status"] == "ok" and row["fully_modelled"]
    row = anchors.anchor_row(_anchor(kind="peak_active"), lambda *_: (_predict_row(), ""))
    assert row["predicted_bytes"] == 2**30 + 2**20


def test_a_failed_prediction_is_an_error_row_with_the_reason():
    row = anchors.anchor_row(_anchor(), lambda *_: (None, "RuntimeError: boom"))
    assert row["status"] == "error" and row["message"] == "RuntimeError: boom" and row["predicted_bytes"] is None


def test_the_summary_takes_median_and_largest_absolute_error():
    rows = [{"anchor": n, "error_pct": e, "fully_modelled": f} for n, e, f in
            (("a", -20.0, False), ("b", 4.0, True), ("c", 2.0, True), ("d", None, False))]
    stats = anchors.summary(rows)
    assert stats["total"] == 4 and stats["predicted"]["rows"] == 3
    assert stats["predicted"]["median_abs_error_pct"] == 4.0 and stats["predicted"]["max_abs_error_pct"] == 20.0
    assert stats["predicted"]["worst"] == "a" and stats["predicted"]["within_15_pct"] == 2
    assert stats["fully_modelled"]["median_abs_error_pct"] == 3.0


# nvidia-smi's terms, at small size


def test_a_tiny_tensor_takes_a_small_pool_segment_and_larger_requests_theirs():
    assert nvidia_smi.segment_bytes(4) == 2 * MiB  # torch.ones((1, 1)) in a fresh process
    assert nvidia_smi.segment_bytes(2 * MiB) == 20 * MiB
    assert nvidia_smi.segment_bytes(12 * MiB + 1) == 14 * MiB


def test_the_context_is_the_sources_baseline_less_its_tensors_segment_else_the_lazy_loading_figure():
    assert nvidia_smi.context_term(1343 * MiB).bytes == 1341 * MiB
    assert nvidia_smi.context_term(None).bytes == CUDA_CONTEXT_BYTES


def test_an_nvidia_smi_row_adds_the_context_to_the_predicted_reserved_memory_and_names_each_term():
    anchor = _anchor(kind="nvidia_smi", unit="MiB", figure=3000, process_baseline_bytes=1343 * MiB)
    row = anchors.anchor_row(anchor, lambda *_: (_predict_row(reserved=1024 * MiB), ""))
    assert row["predicted_bytes"] == 1341 * MiB + 1024 * MiB
    assert "cuda_context=1,341 MiB" in row["predicted_terms"] and "reserved=1,024 MiB" in row["predicted_terms"]
    assert "cuBLAS" in row["not_modelled"]  # what an nvidia-smi row cannot count is said in the row


def test_the_nvidia_smi_baseline_of_a_file_is_read_with_its_unit():
    by_name = {a.name: a for a in ALL}
    assert by_name["transformers-vanilla"].process_baseline_bytes == 1343 * MiB
    assert by_name["torchtune-packed"].process_baseline_bytes is None


# the command


def test_the_command_writes_the_declared_table_and_prints_the_summary(tmp_path, monkeypatch, capsys):
    from bench.measure import fake_cuda

    monkeypatch.setattr(fake_cuda, "environment_python", lambda *a: tmp_path / "python")
    monkeypatch.setattr(anchors, "predict_on_fake_cuda", lambda *_: (_predict_row(reserved=12000 * MiB), ""))
    # as if membench lacked qlora: its row must stay in the table, not modelled
    lacks_qlora = anchors.spec_problem
    monkeypatch.setattr(anchors, "spec_problem", lambda spec: "unknown strategy 'qlora'" if "qlora" in spec
                        else lacks_qlora(spec))
    assert main(["anchors", "--only", "transformers-vanilla,torchtune-qlora", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "median |error|" in out and "transformers-vanilla" in out and "not_modelled" in out
    (path,) = tmp_path.glob("anchors-*.csv")
    frame = pd.read_csv(path)
    assert list(frame.columns) == ANCHORS.names and (frame["schema_version"] == ANCHORS.version).all()
    assert list(frame["anchor"]) == ["torchtune-qlora", "transformers-vanilla"]  # the files' order
    assert frame.set_index("anchor").loc["torchtune-qlora", "status"] == "not_modelled"


def test_anchors_at_once_are_written_in_the_files_order_whatever_finishes_first(tmp_path, monkeypatch, capsys):
    import threading
    import time

    from bench.measure import fake_cuda

    first_started, running, most = threading.Event(), [0], [0]
    lock = threading.Lock()

    def predictor(case, ranks, capability):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        if "qlora" in case["strategy"]:  # the first anchor in the files' order finishes last
            first_started.set()
            time.sleep(0.5)
        else:
            first_started.wait(5)
        with lock:
            running[0] -= 1
        return _predict_row(reserved=12000 * MiB), ""

    monkeypatch.setattr(fake_cuda, "environment_python", lambda *a: tmp_path / "python")
    monkeypatch.setattr(anchors, "predict_on_fake_cuda", predictor)
    assert main(["anchors", "--only", "transformers-vanilla,torchtune-qlora", "--out", str(tmp_path),
                 "--jobs", "2"]) == 0
    assert most[0] == 2  # both at once
    (path,) = tmp_path.glob("anchors-*.csv")
    assert list(pd.read_csv(path)["anchor"]) == ["torchtune-qlora", "transformers-vanilla"]
    assert "(2 at once)" in capsys.readouterr().out


def test_an_unknown_anchor_is_one_line_naming_the_choices(capsys):
    assert main(["anchors", "--only", "no-such-anchor"]) == 2
    err = capsys.readouterr().err
    assert "no-such-anchor" in err and "torchtune" in err and len(err.strip().splitlines()) == 1


def test_a_bad_anchor_file_names_what_is_missing(tmp_path):
    from bench.core.errors import UsageError

    (tmp_path / "x.yaml").write_text("source: {name: x, url: 'https://example.org'}\n"
                                     "rows: [{name: a, label: a, figure: 1, strategy: baseline}]\n")
    with pytest.raises(UsageError, match="kind None"):
        anchors.load_anchors(tmp_path)


def test_the_accuracy_page_is_generated_from_the_csv_alone(tmp_path):
    """docs/accuracy.md comes from an anchors CSV by tools/docs/accuracy_table.py: every row, its error and the
    summary."""
    import importlib.util
    from pathlib import Path

    from bench.core.results import write_table

    rows = [anchors.anchor_row(_anchor(name="a", figure=1.0), lambda *_: (_predict_row(allocated=int(1.1 * 2**30)), "")),
            anchors.anchor_row(_anchor(name="b", strategy="no_such_technique"), lambda *_: None)]
    write_table(ANCHORS, rows, tmp_path / "anchors-x.csv")
    path = Path(__file__).resolve().parent.parent / "tools" / "docs" / "accuracy_table.py"
    spec = importlib.util.spec_from_file_location("accuracy_table", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main([str(tmp_path / "anchors-x.csv"), "--out", str(tmp_path / "accuracy.md")]) == 0
    page = (tmp_path / "accuracy.md").read_text()
    assert "| a |" in page and "+10.0%" in page and "| b |" in page and "not_modelled" in page
    assert "median |error| **10.0%**" in page and "no_such_technique" in page


def test_a_per_gpu_batch_becomes_membenchs_global_batch_over_the_ranks():
    seen = {}
    anchor = _anchor(ranks=2, batch_size=3, batch_per_rank=True)
    row = anchors.anchor_row(anchor, lambda case, ranks, capability: (seen.update(case=case, ranks=ranks)
                                                                       or (_predict_row(), "")))
    assert seen == {"case": {**seen["case"], "batch_size": 6}, "ranks": 2} and row["batch_size"] == 6
    assert {a.name: a.global_batch for a in ALL}["fsdp-lora-2048-batch6"] == 12


def test_packed_rows_reach_the_workload_and_every_source_technique_parses():
    """A row's `packed` becomes the hf workload's packed option (unpacked rows say nothing); every anchor whose
    technique membench has is predicted with its own spec: only FSDP's NO_SHARD falls back (to ddp); every anchor is
    predicted (torchtitan's float8 rows too, since the float8 strategy)."""
    assert _anchor(packed=16, seq_len=4096).workload().endswith(":seq_len=4096:attn=sdpa:task=causal_lm:packed=16")
    assert "packed" not in _anchor().workload()
    by_name = {a.name: a for a in ALL}
    assert by_name["torchtune-packed"].packed == 16 and by_name["torchtune-baseline"].packed == 0
    fallen = [a.name for a in ALL if anchors.plan_row(a)[0] not in (a.strategy, None)]
    assert fallen == ["fsdp-qlora-ddp-batch8", "fsdp-lora-ddp-batch4"]
    assert {a.name for a in ALL if anchors.plan_row(a)[0] is None} == set()
    assert all("checkpoint:segments=all" in a.strategy for a in ALL
               if any(member.split(":")[0] == "checkpoint" for member in a.strategy.split("+")))


def test_anchor_processes_run_at_once_fork_no_worker_for_their_traces(monkeypatch):
    # `anchors --jobs N`: N fake-CUDA processes have the cores already (bench.analysis.proof_beside)
    from bench.core.job_environment import PROOF_BESIDE_VARIABLE

    environments = []

    def run_child(command, env, **options):
        environments.append(env)
        return subprocess.CompletedProcess(command, 1, "", "no prediction here")

    monkeypatch.setattr(anchors.fake_cuda, "environment_python", lambda: "python")
    monkeypatch.setattr(anchors.fake_cuda, "python_environment", lambda: {"PATH": "/bin"})
    monkeypatch.setattr(anchors.processes, "run_child", run_child)
    anchors.predict_on_fake_cuda({}, 1, (9, 0))
    with anchors.cores_shared(True):
        anchors.predict_on_fake_cuda({}, 1, (9, 0))
    anchors.predict_on_fake_cuda({}, 1, (9, 0))
    assert [env.get(PROOF_BESIDE_VARIABLE) for env in environments] == [None, "0", None]
