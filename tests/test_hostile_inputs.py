"""Inputs nobody had tried: user code that leaks global state or exits, configuration files with wrong
types, numbers beyond range, the environment a job runs in, and messages that do not help. One test (or a
parametrized family) per instance found; the CLI runs in this process wherever a subprocess is not the point.
"""

from pathlib import Path

import pandas as pd
import pytest
import torch

from bench.run.isolation import RunOptions, STAGE_MARKER, _flags, crash_message
from bench.run.case import Case
from bench.run.runner import measure_case
from cli_helpers import cli as _cli, main_in_process as _main, one_line_exit_2 as _one_line_exit_2

ROOT = Path(__file__).resolve().parent.parent
HOSTILE = ROOT / "tests" / "fixtures" / "hostile_workload.py"
TINY = ["--phases", "train", "--batch-size", "2", "--device", "cpu", "--warmup", "0", "--steps", "1",
        "--threads", "1"]


def _tiny_case(mode: str) -> Case:
    return Case(f"{HOSTILE}:Tiny:mode={mode}", "baseline", "train", 2, "cpu", warmup=0, steps=1)


def _comparable(flags: dict) -> dict:
    return {key: value for key, value in flags.items() if key != "rng"}


# --- user code that leaks global state or exits ------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["dtype", "grad", "anomaly", "device", "threads", "deterministic"])
def test_a_workload_that_changes_global_state_does_not_change_the_next_case(mode):
    options = RunOptions(threads=1)
    clean = measure_case(_tiny_case("none"), options=options).row
    before = _flags()
    leaky = measure_case(_tiny_case(mode), options=options).row
    assert _comparable(_flags()) == _comparable(before)
    after = measure_case(_tiny_case("none"), options=options).row
    assert after["status"] == clean["status"] == "ok", (leaky, after)
    assert after["peak_mem_bytes"] == clean["peak_mem_bytes"]


def test_sys_exit_in_a_users_loss_is_an_error_row_and_the_cli_goes_on(tmp_path):
    done = _main("compare", "--strategies", "baseline", "--workload", f"{HOSTILE}:Tiny:mode=exit", *TINY,
                 "--no-isolate", "--out", tmp_path)
    assert done.returncode == 1, done.stderr
    row = pd.read_csv(next(tmp_path.glob("*.csv"))).iloc[0]
    assert row["status"] == "error" and "sys.exit(0)" in row["message"]


def test_under_isolate_the_preflight_steps_that_run_a_users_loss_run_in_a_child(capsys):
    """Os._exit(0) in the loss during the first case's calibration ends the child, not this process: a warning, no
    figure, and the run goes on (each case's worker then ends the same way: `crash_message(0, ...)` below names it).
    One process start, where the CLI end to end would take two (20 s on the loaded 2-core machine)."""
    from bench.cli.preflight_steps import user_code_steps_in_child

    assert user_code_steps_in_child([_tiny_case("os_exit")], False, None, 10.0) is None
    err = capsys.readouterr().err
    assert "pre-flight checks" in err and "exit code 0" in err, err


def test_under_isolate_a_workload_that_exits_while_it_is_built_is_one_line_not_silence(tmp_path):
    """Os._exit(0) in a user's workload `__init__` (or its module's import): under --isolate the workload is first
    built in a child, so the CLI says so in one line and exits 2, where it used to end with exit code 0 and nothing."""
    done = _cli("compare", "--strategies", "baseline", "--workload", f"{HOSTILE}:ExitingInit", *TINY, "--isolate",
                "--out", tmp_path)
    _one_line_exit_2(done, f"{HOSTILE}:ExitingInit", "exit code 0")
    assert not list(tmp_path.glob("*.csv"))


@pytest.mark.parametrize("command", [["predict", "--device", "cpu", "--phases", "train"],
                                     ["explain", "--strategy", "baseline"]])
def test_sys_exit_in_a_users_loss_ends_other_commands_with_a_line_not_silently(command, tmp_path):
    done = _main(*command, "--workload", f"{HOSTILE}:Tiny:mode=exit", "--batch-size", "2", "--out", tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: the workload's code called sys.exit(0) during "
                                                           f"`{command[0]}`"), done.stderr


def test_a_crashed_workers_row_shows_its_last_real_line_not_a_marker():
    stderr = f"{STAGE_MARKER}verification\nRuntimeError: boom\n{STAGE_MARKER}timing\n"
    assert crash_message(1, stderr) == "worker crashed (exit code 1): RuntimeError: boom"
    only_markers = crash_message(-9, f"{STAGE_MARKER}memory\n")
    assert STAGE_MARKER.strip() not in only_markers and "during memory" in only_markers
    assert "workload's code exited" in crash_message(0, f"{STAGE_MARKER}timing\n")


@pytest.mark.parametrize("name, error", [("broken_factory", "RuntimeError: the factory is broken"),
                                         ("BrokenInit", "ValueError: the init is broken")])
def test_a_workload_whose_factory_or_init_raises_is_one_line(name, error, tmp_path):
    done = _main("compare", "--strategies", "baseline", "--workload", f"{HOSTILE}:{name}", *TINY, "--out", tmp_path)
    _one_line_exit_2(done, name, error)


# --- configuration files with wrong types ------------------------------------------------------------------------

def _config(tmp_path, **changes) -> Path:
    import json

    from workloads.framework.hf_presets import PRESETS

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**PRESETS["tiny-llama"], **changes}).replace("Infinity", "1e400"))
    return path


@pytest.mark.parametrize("changes, named", [
    ({"num_hidden_layers": "2"}, ["num_hidden_layers", "'2'", "str", "integer"]),
    ({"num_hidden_layers": 2.5}, ["num_hidden_layers", "2.5", "float"]),
    ({"num_hidden_layers": -1}, ["num_hidden_layers", "-1"]),
    ({"hidden_size": float("inf")}, ["hidden_size", "1e400"]),
    ({"vocab_size": [512]}, ["vocab_size", "[512]", "list"]),
    ({"num_attention_heads": True}, ["num_attention_heads", "bool"]),
    ({"intermediate_size": -64}, ["intermediate_size", "-64", "or null"]),
    ({"max_position_embeddings": "128"}, ["max_position_embeddings", "'128'"]),
    ({"model_type": ["llama"]}, ["model_type", "['llama']"]),
    ({"rms_norm_eps": "small"}, ["rms_norm_eps", "transformers refuses"]),
])
def test_a_config_value_of_the_wrong_type_or_range_is_one_line_naming_the_field(changes, named, tmp_path):
    path = _config(tmp_path, **changes)
    done = _main("predict", "--workload", f"hf:{path}", "--batch-size", "1", "--phases", "train", "--device", "cpu",
                 "--out", tmp_path)
    _one_line_exit_2(done, str(path), *named)


def test_a_gpt2_style_config_is_checked_under_its_own_field_names(tmp_path):
    from workloads.framework.hf_presets import PRESETS

    path = tmp_path / "gpt2.json"
    path.write_text(__import__("json").dumps({**PRESETS["gpt2"], "n_layer": "12"}))
    done = _main("predict", "--workload", f"hf:{path}", "--out", tmp_path)
    _one_line_exit_2(done, "n_layer (num_hidden_layers)", "'12'")


def test_a_config_whose_model_needs_petabytes_is_refused_with_the_figure_before_any_case(tmp_path):
    path = _config(tmp_path, num_hidden_layers=10**9, hidden_size=4096, intermediate_size=14336)
    done = _main("compare", "--strategies", "baseline", "--workload", f"hf:{path}", *TINY, "--out", tmp_path)
    _one_line_exit_2(done, "PiB of float32 weights", "2.27e+17 parameters", "num_hidden_layers=1,000,000,000")
    assert not list(tmp_path.glob("*.csv"))


def test_the_parameter_count_on_meta_is_the_models_own():
    """One and two layers counted on meta, extrapolated to three: the real three-layer model's count (tied heads
    counted once)."""
    from workloads import get_workload, hf
    from workloads.framework import hf_checks

    model = get_workload("hf:tiny-llama").build_model()  # two layers
    values = {**hf.config_values("tiny-llama"), "num_hidden_layers": 3}
    transformers = hf.import_transformers()

    def build(layers):
        return type(model)(hf.make_config(transformers, values, layers))

    three = sum(p.numel() for p in build(3).parameters())
    assert hf_checks.parameter_count(values, "causal_lm", 3, build) == three
    assert hf_checks.parameter_count(values, "causal_lm", 2, build) == sum(p.numel() for p in model.parameters())


# --- numbers beyond range ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("budget", ["1e30", "2000TiB"])
def test_a_budget_beyond_a_petabyte_is_refused_before_the_search(budget, tmp_path):
    done = _main("plan", "--budget", budget, "--workload", "deep_mlp:layers=4:width=8", "--out", tmp_path)
    _one_line_exit_2(done, "--budget", budget, "1.0 PiB")
    assert not list(tmp_path.iterdir())


def test_predict_where_no_case_is_predicted_exits_1_with_a_line(tmp_path):
    path = _config(tmp_path, num_key_value_heads=3)  # 4 heads do not share 3 key/value heads: every row an error
    done = _main("predict", "--workload", f"hf:{path}", "--batch-size", "1", "--phases", "train", "--device", "cpu",
                 "--out", tmp_path)
    assert done.returncode == 1, done.stderr
    assert "no case was predicted (1 error)" in done.stderr


@pytest.mark.parametrize("args, named", [
    (["compare", "--strategies", "checkpoint:segments=2:segments=3"], ["checkpoint:segments", "twice"]),
    (["predict", "--workload", "deep_mlp:layers=4:layers=8"], ["deep_mlp:layers", "twice"]),
])
def test_an_option_given_twice_is_refused_naming_it(args, named, tmp_path):
    extra = [] if "--workload" in args else ["--workload", "deep_mlp:layers=4:width=8"]
    _one_line_exit_2(_main(*args, *extra, "--device", "cpu", "--out", tmp_path), *named)


@pytest.mark.parametrize("args, named", [
    (["predict", "--ranks", "1000000"], ["--ranks", "1,000,000", "131,072"]),
    (["plan", "--budget", "1GiB", "--ranks", "1000000"], ["--ranks", "131,072"]),
    (["compare", "--strategies", "ddp", "--device", "cpu", "--ranks", "4096"], ["--ranks", "4,096", "CPU cores"]),
    (["compare", "--strategies", "baseline", "--device", "cpu", "--repeats", "1000000000"], ["--repeats", "100"]),
])
def test_ranks_and_repeats_beyond_what_can_run_are_refused(args, named, tmp_path):
    _one_line_exit_2(_main(*args, "--workload", "deep_mlp:layers=4:width=8", "--out", tmp_path), *named)


def _tiny_run(tmp_path) -> Path:
    done = _main("compare", "--strategies", "baseline", "--workload", "deep_mlp:layers=4:width=8", *TINY,
                 "--no-isolate", "--out", tmp_path)
    assert done.returncode == 0, done.stderr
    return next(p for p in tmp_path.glob("*.csv") if not p.name.endswith(".timeline.csv"))


def test_resume_refuses_a_file_of_a_newer_schema_and_keeps_whole_numbers_whole(tmp_path):
    from bench.core.results import RESULTS, SCHEMA_VERSION

    path = _tiny_run(tmp_path)
    done = _main("compare", "--strategies", "baseline,inplace_relu", "--workload", "deep_mlp:layers=4:width=8",
                 *TINY, "--no-isolate", "--resume", path)
    assert done.returncode == 0, done.stderr
    text = pd.read_csv(path, dtype=str)
    assert len(text) == 2
    for column in RESULTS.names_of("int"):
        if column in text:
            assert not text[column].dropna().str.endswith(".0").any(), (column, text[column].tolist())
    frame = pd.read_csv(path)
    frame["schema_version"] = SCHEMA_VERSION + 1
    frame.to_csv(path, index=False)
    done = _main("compare", "--strategies", "baseline,inplace_relu,amp", "--workload", "deep_mlp:layers=4:width=8",
                 *TINY, "--no-isolate", "--resume", path)
    _one_line_exit_2(done, "newer membench", f"schema_version {SCHEMA_VERSION + 1}")


# --- the environment a job runs in -------------------------------------------------------------------------------

LAUNCHER = {"WORLD_SIZE": "8", "RANK": "3", "LOCAL_RANK": "3", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "job"}


def test_a_torchrun_shells_variables_reach_no_process_membench_starts(monkeypatch):
    from bench.run.isolation import worker_env

    for name, value in LAUNCHER.items():
        monkeypatch.setenv(name, value)
    assert not set(LAUNCHER) & set(worker_env())
    done = _main("list")
    assert done.returncode == 0
    assert done.stderr.count("note: ignoring") == 1 and "WORLD_SIZE=8" in done.stderr, done.stderr
    import os

    assert not set(LAUNCHER) & set(os.environ)  # cleared here too: every child (plan, predict, Ray) starts clean


@pytest.mark.parametrize("command", [["predict"], ["explain", "--strategy", "baseline"],
                                     ["compare", "--strategies", "baseline", *TINY], ["plan", "--budget", "1GiB"]])
def test_a_bad_cpu_16bit_setting_is_refused_before_anything_by_every_command(command, monkeypatch, tmp_path):
    monkeypatch.setenv("MEMBENCH_CPU_16BIT", "garbage")
    done = _main(*command, "--workload", "deep_mlp:layers=4:width=8", "--out", tmp_path)
    _one_line_exit_2(done, "MEMBENCH_CPU_16BIT", "'garbage'", "auto, emulated, native")
    assert done.stdout == "" and not list(tmp_path.iterdir())


def test_a_missing_plugin_module_is_refused_before_the_first_case(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMBENCH_PLUGINS", "json,no_such_membench_plugin")
    done = _main("compare", "--strategies", "baseline", "--workload", "deep_mlp:layers=4:width=8", *TINY,
                 "--out", tmp_path)
    _one_line_exit_2(done, "MEMBENCH_PLUGINS", "'no_such_membench_plugin'")


def test_a_garbage_ray_address_in_the_environment_is_refused_before_ray_starts(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_ADDRESS", "not an address")
    done = _main("compare", "--strategies", "baseline", "--workload", "deep_mlp:layers=4:width=8", *TINY,
                 "--executor", "ray", "--out", tmp_path)
    _one_line_exit_2(done, "$RAY_ADDRESS", "'not an address'")


# --- messages that do not help -----------------------------------------------------------------------------------

def test_lora_without_default_targets_lists_the_models_linear_module_names():
    from bench.core.errors import Unsupported
    from bench.run.case import bind_case

    strategy, context = bind_case(Case("gpt_mini:layers=2", "lora", "train", 2, "cpu"))
    with pytest.raises(Unsupported) as raised:
        strategy.check(context)
    message = str(raised.value)
    listed = message.split("its Linear modules: ")[1].rstrip(")").split(", ")
    assert len(listed) == len(set(listed)) >= 2, message  # each suffix once, however many layers repeat it
    assert all("." not in name for name in listed), message


def test_the_linear_names_are_read_on_a_model_that_holds_no_memory(monkeypatch):
    from strategies.framework import module_names
    from workloads import get_workload

    workload = get_workload("deep_mlp:layers=3:width=8")
    built = []
    original = type(workload).build_model

    def spying(self):
        model = original(self)
        built.append({p.device.type for p in model.parameters()})
        return model

    monkeypatch.setattr(type(workload), "build_model", spying)
    assert module_names.linear_module_suffixes(workload) == ["0", "1", "2"]
    assert built == [{"meta"}]


def test_progress_lines_name_every_option_of_the_workload_even_at_its_default():
    from workloads import get_workload

    canonical = get_workload("deep_mlp:layers=1000:width=8").spec()  # a suite's cases and rows leave defaults out
    assert canonical == "deep_mlp:width=8"
    case = Case(canonical, "baseline", "eval", 2, "cpu")
    assert case.label().startswith("deep_mlp:layers=1000:width=8 baseline eval bs=2")


def test_a_workload_that_fails_to_build_inside_a_case_is_an_error_row_not_unsupported():
    case = Case(f"{HOSTILE}:broken_factory", "baseline", "train", 2, "cpu", data="synthetic", warmup=0, steps=1)
    row = measure_case(case).row
    assert row["status"] == "error" and "the factory is broken" in row["message"], row


def test_predict_keeps_a_workloads_global_state_in_its_own_case():
    from bench.analysis.predict import predict_cases

    def case(mode):
        return Case(f"{HOSTILE}:Tiny:mode={mode}", "baseline", "train", 2, "cpu", data="synthetic")

    (clean,) = predict_cases([case("none")])
    leaky, after = predict_cases([case("dtype"), case("none")])
    assert torch.get_default_dtype() == torch.float32
    assert after["predicted_bytes"] == clean["predicted_bytes"] != leaky["predicted_bytes"]
