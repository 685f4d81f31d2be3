"""16-bit autocast on a CPU that emulates it: the setting that forces the path, the fake-tensor count it relies on
(equal to a real step's on every built-in workload, to the byte), the row of an emulated case, and fit's answers.

MEMBENCH_CPU_16BIT=emulated makes any CPU take the emulated path, so these run the same on a CPU with bfloat16
instructions and on one without. Cases are tiny (batches 1-8, small workload options).
"""

from __future__ import annotations

import pytest

import conformance
from bench.analysis import fit
from bench.core.errors import UsageError
from bench.measure import cpu_16bit, env
from bench.run import eta, runner
from bench.run.fake_pass import fake_memory_pass
from bench.run.case import Case, bind_case
from bench.run.runner import memory_pass, run_case
from workloads import workload_names

MLP = "deep_mlp:layers=24:width=8"
FIT_MLP = "deep_mlp:layers=4:width=8"  # fit runs many probes: the smallest model with a peak that grows with the batch


def cpu_case(workload: str, strategy: str, batch: int, phase: str = "train", steps: int = 1) -> Case:
    return Case(workload, strategy, phase, batch, "cpu", data="synthetic", warmup=0, steps=steps)


# --- the setting ---------------------------------------------------------------------------------------------

def test_the_setting_forces_the_emulated_or_the_native_path(monkeypatch):
    monkeypatch.setenv("MEMBENCH_CPU_16BIT", "emulated")
    assert cpu_16bit.cpu_16bit_support() == {"bfloat16": False, "float16": False}
    assert cpu_16bit.emulated_on_cpu("bfloat16", "cpu") and not cpu_16bit.emulated_on_cpu("bfloat16", "cuda")
    assert not cpu_16bit.emulated_on_cpu(None, "cpu")
    # a CPU's flags given explicitly are that CPU's answer, whatever the setting
    assert cpu_16bit.cpu_16bit_support({"avx512_bf16"})["bfloat16"] is True
    monkeypatch.setenv("MEMBENCH_CPU_16BIT", "native")
    assert cpu_16bit.cpu_16bit_support() == {"bfloat16": True, "float16": True}
    assert not cpu_16bit.emulated_on_cpu("float16", "cpu")
    monkeypatch.setenv("MEMBENCH_CPU_16BIT", "auto")
    for variable in cpu_16bit.ONEDNN_ISA_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    assert cpu_16bit.cpu_16bit_support() == cpu_16bit.cpu_16bit_support(cpu_16bit.cpu_flags())


@pytest.mark.parametrize("variable", cpu_16bit.ONEDNN_ISA_VARIABLES)
def test_a_onednn_cap_below_the_cpu_s_16bit_instructions_makes_them_emulated(monkeypatch, capsys, variable):
    # oneDNN capped at AVX2 runs bfloat16 matmuls and convolutions emulated (32-37x float32 on the AMD EPYC with
    # AVX-512 bfloat16): an AVX2-only CPU on any machine, measured, not only treated as one (MEMBENCH_CPU_16BIT)
    from bench.cli.commands_run import cpu_16bit_lines

    monkeypatch.delenv("MEMBENCH_CPU_16BIT", raising=False)
    for other in cpu_16bit.ONEDNN_ISA_VARIABLES:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setattr(cpu_16bit, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert cpu_16bit.cpu_16bit_support() == {"bfloat16": True, "float16": False}
    expected = {"avx2": False, "AVX512_CORE": False, "avx2_vnni_2": True, "AVX512_CORE_BF16": True,
                "AVX512_CORE_AMX": True, "ALL": True, "no-such-isa": True}
    for cap, native in expected.items():
        monkeypatch.setenv(variable, cap)
        assert cpu_16bit.cpu_16bit_support()["bfloat16"] is native, cap
        assert cpu_16bit.emulated_on_cpu("bfloat16", "cpu") is not native, cap
    monkeypatch.setenv(variable, "AVX2")
    assert cpu_16bit.cpu_16bit_support({"avx512_bf16"})["bfloat16"] is True  # another CPU's flags: no cap of this process
    assert env.environment("cpu")["cpu_capability"].endswith("; oneDNN AVX2")
    assert env.environment("cpu")["cpu_bf16_native"] is False
    line = cpu_16bit_lines()[0]
    assert "EMULATED" in line and f"capped at AVX2 by {variable}" in line and "avx512_bf16" in line, line
    case = Case("deep_mlp", "amp", "train", 8, "cpu")
    note = eta.emulation_warning(case, "bfloat16", "a CPU", 100.0, slowdown=(30.0, 40.0))
    assert f"capped at AVX2 by {variable}" in note and "has no instructions" not in note, note
    monkeypatch.setenv("MEMBENCH_CPU_16BIT", "native")  # the setting still overrides
    assert cpu_16bit.cpu_16bit_support()["bfloat16"] is True


def test_a_bad_setting_is_one_line_naming_the_choices(monkeypatch, capsys):
    from bench.cli.main import main

    monkeypatch.setenv("MEMBENCH_CPU_16BIT", "sometimes")
    with pytest.raises(UsageError, match="'sometimes'.*auto, emulated, native"):
        cpu_16bit.cpu_16bit_support()
    assert main(["env", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MEMBENCH_CPU_16BIT" in err[0] and "Traceback" not in err[0]


# --- the fake-tensor count of 16-bit autocast ----------------------------------------------------------------

@pytest.mark.parametrize("name", workload_names())
def test_fake_tensors_count_16bit_autocast_as_the_cpu_does_to_the_byte(name):
    # the emulated path's memory is this count: it must be the real step's exactly (BatchNorm's float32 statistics
    # and the losses' CPU buffers included: bench.measure.fake_cpu); each workload at its `small_for["emulated16"]`
    conformance.check_fake_16bit_count(name)


@pytest.mark.parametrize("strategy, phase", [("checkpoint+amp", "train"), ("amp", "eval")])
def test_fake_tensors_count_the_default_suites_16bit_cases_exactly(strategy, phase):
    case = cpu_case("captcha_resnet18", strategy, 2, phase)
    assert (fake_memory_pass(case, bind_case(case)[0])["peak_mem_bytes"]
            == memory_pass(case, bind_case(case)[0])["peak_mem_bytes"])


# --- the estimate printed before an emulated case --------------------------------------------------------------

def test_the_emulation_slowdown_is_measured_here_once_per_process(monkeypatch):
    calls = []
    timed = eta._median_seconds
    monkeypatch.setattr(eta, "_median_seconds", lambda call: calls.append(call) or timed(call))
    eta.emulated_slowdown.cache_clear()
    low, high = eta.emulated_slowdown("bfloat16")
    assert 0 < low <= high < 1000 and len(calls) == 4  # a matrix product and a convolution, in float32 and bfloat16
    assert eta.emulated_slowdown("bfloat16") == (low, high) and len(calls) == 4
    case = Case("captcha_resnet18", "amp", "train", 100, "cpu", data="synthetic", warmup=1, steps=None, min_steps=1,
                max_time_s=10.0)
    assert f"{low:.1f}-{high:.1f}x float32's time" in eta.emulation_warning(case, "bfloat16", "a CPU", 5681.0)


# --- the row of an emulated case -----------------------------------------------------------------------------

@pytest.fixture
def verified_batches(monkeypatch):
    """The batch size of every verification the runner runs."""
    seen = []
    verify = runner.verify

    def spy(case, strategy):
        seen.append(case.batch_size)
        return verify(case, strategy)

    monkeypatch.setattr(runner, "verify", spy)
    return seen


def test_an_emulated_case_is_verified_small_counted_on_fake_tensors_and_marked(monkeypatch, verified_batches):
    monkeypatch.setenv("MEMBENCH_CPU_16BIT", "emulated")
    case = cpu_case(MLP, "amp", 8, steps=3)
    row = run_case(case, env={})
    assert row["status"] == "ok" and row["matches_baseline"] is True, row["message"]
    assert row["emulated_16bit"] is True
    assert verified_batches == [runner.EMULATED_VERIFY_BATCH] == [row["verify_batch_size"]]
    assert "emulated" in row["message"] and f"batch {runner.EMULATED_VERIFY_BATCH}" in row["message"]
    assert row["memory_method"] == "cpu_fake_live_tensor_bytes"
    assert row["peak_mem_bytes"] == memory_pass(case, bind_case(case)[0])["peak_mem_bytes"]  # the real count
    # timing: no warm-up, adaptive from one step under the cap, whatever fixed count the case asked for
    assert row["warmup_steps"] == 0 and row["measured_steps"] >= 1 and row["timing_fixed_steps"] is None
    assert row["timing_min_steps"] == 1 and row["timing_max_time_s"] == runner.EMULATED_MAX_TIME_S


def test_a_native_case_and_a_float32_case_take_the_full_path(monkeypatch, verified_batches):
    monkeypatch.setenv("MEMBENCH_CPU_16BIT", "native")
    amp = run_case(cpu_case(MLP, "amp", 8), env={})
    monkeypatch.setenv("MEMBENCH_CPU_16BIT", "emulated")
    baseline = run_case(cpu_case(MLP, "baseline", 8), env={})
    for row in (amp, baseline):
        assert row["status"] == "ok" and row["emulated_16bit"] is False, row["message"]
        assert row["verify_batch_size"] == 8 and row["memory_method"] == "cpu_live_tensor_bytes"
    assert verified_batches == [8, 8]


# --- fit -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("setting", ["emulated", "native"])
def test_fit_answers_the_largest_batch_under_the_budget_by_real_steps(monkeypatch, setting):
    # the answer b of each strategy: a real tracked step at b is under the budget, one at b + 1 over it
    monkeypatch.setenv("MEMBENCH_CPU_16BIT", setting)
    budget = memory_pass(cpu_case(FIT_MLP, "baseline", 40), bind_case(cpu_case(FIT_MLP, "baseline", 40))[0],
                         growth_steps=0)["peak_mem_bytes"]
    results = fit.fit(["amp"], budget, workload=FIT_MLP, data="synthetic", max_batch=512, time_steps=0)
    assert [r.strategy for r in results] == ["baseline", "amp"]
    for result in results:
        assert result.verified and result.batch_size >= 1, result
        real = {b: memory_pass(cpu_case(FIT_MLP, result.strategy, b), bind_case(cpu_case(FIT_MLP, result.strategy, b))[0],
                               growth_steps=0)["peak_mem_bytes"] for b in (result.batch_size, result.batch_size + 1)}
        assert result.peak_bytes == real[result.batch_size] <= budget < real[result.batch_size + 1]
    assert results[0].batch_size == 40
