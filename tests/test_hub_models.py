"""`hf:org/name`: a Hub model's config.json read through huggingface_hub from a cache built here, offline; nothing
in these tests reaches the network (HF_HUB_OFFLINE=1 in every process that reads the Hub)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

import hub_cache
from workloads.framework.hf_presets import PRESETS

pytest.importorskip("transformers")

PREDICT = [sys.executable, "-m", "bench", "predict", "--device", "cpu", "--batch-size", "1", "--phases", "train"]
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"

REMOTE_CONFIG = {**PRESETS["tiny-llama"], "model_type": "acme_llama", "architectures": ["AcmeForCausalLM"],
                 "auto_map": {"AutoConfig": "configuration_acme.AcmeConfig",
                              "AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM"}}
REMOTE_CODE = {
    "configuration_acme.py": "from transformers import LlamaConfig\n\n\nclass AcmeConfig(LlamaConfig):\n"
                             "    model_type = 'acme_llama'\n",
    "modeling_acme.py": "from transformers import LlamaForCausalLM\n\nfrom .configuration_acme import AcmeConfig\n\n\n"
                        "class AcmeForCausalLM(LlamaForCausalLM):\n    config_class = AcmeConfig\n",
}


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory) -> Path:
    """HF_HOME with a cache of three models: tiny-llama's numbers on main and, at another commit tagged v2, with 3
    layers; a model with remote code; nothing else."""
    home = tmp_path_factory.mktemp("hf_home")
    hub_cache.add_model(home / "hub", "acme/tiny-llama", {"config.json": PRESETS["tiny-llama"]})
    hub_cache.add_model(home / "hub", "acme/tiny-llama", {"config.json": {**PRESETS["tiny-llama"],
                                                                         "num_hidden_layers": 3}},
                        commit=OTHER_COMMIT, branch="v2")
    hub_cache.add_model(home / "hub", "acme/custom", {"config.json": REMOTE_CONFIG, **REMOTE_CODE})
    return home


@pytest.fixture
def offline_hub(hub_home, monkeypatch):
    """This process reads the Hub from `hub_home`'s cache only, as HF_HOME and HF_HUB_OFFLINE=1 would make it."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub_home


def predicted_row(workload: str) -> dict:
    from bench.analysis.predict import predict_cases
    from bench.run.case import Case

    (row,) = predict_cases([Case(workload, "baseline", "train", 1, "cpu")])
    assert row["status"] == "ok", row["message"]
    return row


def test_a_hub_model_is_read_from_the_cache_offline_and_the_row_names_its_file_and_commit(offline_hub):
    row = predicted_row("hf:acme/tiny-llama:seq_len=16")
    expected_file = offline_hub / "hub" / "models--acme--tiny-llama" / "snapshots" / hub_cache.COMMIT / "config.json"
    assert row["workload_source"] == f"acme/tiny-llama@{hub_cache.COMMIT}: {expected_file}"
    # the same numbers as the preset they were copied from: the same prediction, to the byte
    assert row["predicted_bytes"] == predicted_row("hf:tiny-llama:seq_len=16")["predicted_bytes"]
    assert predicted_row("hf:tiny-llama:seq_len=16")["workload_source"] is None


def test_a_revision_reads_the_file_of_that_revision(offline_hub):
    row = predicted_row("hf:acme/tiny-llama@v2:seq_len=16")
    assert row["workload_source"].startswith(f"acme/tiny-llama@{OTHER_COMMIT}: ")
    assert row["predicted_bytes"] > predicted_row("hf:tiny-llama:seq_len=16")["predicted_bytes"]  # 3 layers, not 2


@pytest.mark.parametrize("workload, words", [
    ("hf:acme/not-cached", ["acme/not-cached", "not in the Hugging Face cache", "HF_HUB_OFFLINE",
                            "hf download acme/not-cached config.json"]),
    ("hf:acme/tiny-llama@v3", ["acme/tiny-llama", "revision 'v3'", "--revision v3"]),
    ("hf:acme/custom:seq_len=16", ["acme/custom", "not in transformers", "configuration_acme.AcmeConfig",
                                   "trust_remote_code=true"]),
])
def test_what_cannot_be_read_or_run_is_refused_naming_the_id_and_what_to_do(offline_hub, workload, words):
    from bench.core.errors import UsageError
    from workloads import get_workload

    with pytest.raises(UsageError) as refusal:
        get_workload(workload)
    message = str(refusal.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def run_predict(hub_home: Path, tmp_path: Path, workload: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    result = subprocess.run([*PREDICT, "--workload", workload, "--out", str(tmp_path)], capture_output=True,
                            text=True, env=hub_cache.offline_environment(hub_home), timeout=300)
    files = sorted(tmp_path.glob("predict-*.csv"))
    rows = list(csv.DictReader(files[-1].open())) if files and result.returncode == 0 else []
    return result, rows


def test_the_command_line_with_nothing_cached_is_one_line_exit_2(hub_home, tmp_path):
    result, _ = run_predict(hub_home, tmp_path, "hf:acme/not-cached")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "acme/not-cached" in lines[0] and "Traceback" not in result.stderr, result.stderr


def test_remote_code_runs_when_the_user_trusts_it(hub_home, tmp_path):
    """In its own process: transformers imports the repository's code into HF_HOME's modules folder."""
    result, (row,) = run_predict(hub_home, tmp_path, "hf:acme/custom:seq_len=16:trust_remote_code=true")
    assert result.returncode == 0, result.stderr
    assert row["workload_source"].startswith(f"acme/custom@{hub_cache.COMMIT}: ")
    # the repository's classes are tiny-llama's under another name: the same step
    assert int(row["predicted_bytes"]) == predicted_row("hf:tiny-llama:seq_len=16")["predicted_bytes"]


def test_hub_ids_and_local_paths_are_told_apart(tmp_path, monkeypatch):
    from workloads.framework.hf_config import is_file_reference, is_hub_id

    assert is_hub_id("Qwen/Qwen2.5-7B-Instruct") and is_hub_id("mistralai/Mixtral-8x7B-v0.1@main")
    assert not is_hub_id("gpt2") and not is_hub_id("path/to/config.json") and not is_hub_id("a/b/c")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme" / "local").mkdir(parents=True)  # a folder on disk of an id's form is the user's folder
    assert not is_hub_id("acme/local") and is_file_reference("acme/local")


def test_the_python_api_takes_a_hub_id(offline_hub):
    import membench

    estimate = membench.estimate("hf:acme/tiny-llama:seq_len=16", device="cpu", batch_size=1)
    assert estimate.status == "ok"
    assert estimate.allocated_bytes == predicted_row("hf:tiny-llama:seq_len=16")["predicted_bytes"]
    assert estimate.row["workload_source"].startswith(f"acme/tiny-llama@{hub_cache.COMMIT}: ")
