"""Suite files are rejected before anything runs, with the file, the key and the reason in one message."""

from pathlib import Path

import pytest

from bench.cli.main import main
from bench.core.errors import UsageError
from bench.run.suite import load_suite

GOOD = "strategies: [baseline]\nphases: [eval]\nbatch_sizes: [2]\ndata: synthetic\nwarmup: 0\nsteps: 1\n"


@pytest.mark.parametrize("text, key, reason", [
    ("strategies: [baseline, nonsense]", "strategies", "unknown strategy 'nonsense'"),
    ("strategies: []", "strategies", "must not be empty"),
    ("strategies: [baseline, baseline]", "strategies", "duplicate entry 'baseline'"),
    ("strategies: baseline", "strategies", "must be a list"),
    ("strategies: [1]", "strategies", "must be a name"),
    ("batch_sizes: [0]", "batch_sizes", "positive integer"),
    ("batch_sizes: [-4]", "batch_sizes", "positive integer"),
    ("batch_sizes: [2.5]", "batch_sizes", "positive integer"),
    ("batch_sizes: [true]", "batch_sizes", "positive integer"),
    ("batch_sizes: [2, 2]", "batch_sizes", "duplicate entry 2"),
    ("batch_sizes: []", "batch_sizes", "must not be empty"),
    ("phases: [train, test]", "phases", "unknown phase 'test'"),
    ("phases: []", "phases", "must not be empty"),
    ("steps: \"ten\"", "steps", "must be a positive integer"),
    ("steps: 0", "steps", "must be a positive integer"),
    ("warmup: -1", "warmup", "non-negative"),
    ("min_steps: 0", "min_steps", "must be a positive integer"),
    ("max_time_per_case: -5", "max_time_per_case", "positive number of seconds"),
    ("max_time_per_case: soon", "max_time_per_case", "positive number of seconds"),
    ("target_ci: 1.5", "target_ci", "between 0 and 1"),
    ("steps: 3\nmin_steps: 2", "steps", "give one or the other"),
    ("warmup: true", "warmup", "non-negative"),
    ("data: mnist", "data", "unknown data source 'mnist'"),
    ("workload: resnet50", "workload", "unknown workload 'resnet50'"),
    ("batchsizes: [2]", "batchsizes", "unknown key"),
    ("devices: {tpu: {steps: 1}}", "devices.tpu", "unknown device 'tpu'"),
    ("devices: [cuda]", "devices", "must map"),
    ("devices: {cuda: 3}", "devices.cuda", "must be a mapping"),
    ("devices: {cuda: {steps: \"ten\"}}", "steps", "must be a positive integer"),
    ("devices: {cuda: {bogus: 1}}", "bogus", "unknown key"),
    ("devices: {cpu: {strategies: [nonsense]}}", "strategies", "unknown strategy"),
])
def test_a_bad_suite_names_file_key_and_reason(tmp_path, text, key, reason):
    path = tmp_path / "bad_suite.yaml"
    path.write_text(text + "\n")
    with pytest.raises(UsageError) as caught:
        load_suite(path, "cpu")
    message = str(caught.value)
    assert str(path) in message and repr(key).strip("'") in message and reason in message, message


def test_nested_override_errors_say_which_device(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("devices:\n  cuda:\n    batch_sizes: [0]\n")
    with pytest.raises(UsageError, match=r"devices\.cuda.*batch_sizes.*positive"):
        load_suite(path, "cpu")  # checked even when running on the other device


def test_a_bad_suite_fails_before_any_case_runs(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(GOOD + "devices: {cpu: {steps: \"ten\"}}\n")
    out = tmp_path / "out"
    assert main(["run", "--suite", str(path), "--device", "cpu", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "s.yaml" in err and "'steps'" in err
    assert not out.exists()


def test_good_suites_load(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(GOOD + "devices: {cuda: {steps: 30}}\n")
    suite = load_suite(path, "cpu")
    assert suite.steps == 1 and suite.batch_sizes == [2]
    assert load_suite(path, "cuda").steps == 30


def test_a_device_with_adaptive_keys_replaces_a_fixed_count(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(GOOD + "devices: {cuda: {min_steps: 20, max_time_per_case: 30, target_ci: 0.02}}\n")
    [case] = load_suite(path, "cuda").cases("cuda")
    assert case.steps is None and (case.min_steps, case.max_time_s, case.target_ci_rel) == (20, 30.0, 0.02)
    [case] = load_suite(path, "cpu").cases("cpu")
    assert case.steps == 1


def test_the_default_cpu_suite_is_adaptive_with_a_budget_that_caps_slow_cases():
    """A bfloat16 step that the CPU emulates (83 s at batch 100 on the EPYC of captcha_no_bf16) must time one step."""
    from bench.run.suite import DEFAULT_SUITE

    cases = load_suite(DEFAULT_SUITE, "cpu").cases("cpu")
    assert {c.batch_size for c in cases} >= {100} and {c.phase for c in cases} == {"train", "eval"}
    for case in cases:
        assert case.steps is None and case.min_steps == 1 and case.max_time_s < 83


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parent.parent / "bench" / "suites").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_suites_load_and_name_registered_strategies(path):
    from strategies import parse_strategy

    for device in ("cpu", "cuda"):
        for case in load_suite(path, device).cases(device):
            parse_strategy(case.strategy)
