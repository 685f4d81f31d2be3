"""Adaptive timing in a row, the CPU's native 16-bit arithmetic (detected from injected flags), the note before a
case whose 16-bit autocast the CPU emulates, and the sweep's estimate of the time left."""

import io

import pytest

from bench.cli.commands_run import cpu_16bit_lines
from bench.cli.console import Progress
from bench.measure import cpu_16bit
from bench.run import eta
from bench.run.case import Case
from bench.run.runner import run_case

TINY = "deep_mlp:layers=4:width=8"


@pytest.mark.parametrize("flags, bf16, fp16", [
    ({"fpu", "avx2", "avx512f"}, False, False),  # the AMD EPYC of captcha_no_bf16: AVX2, no 16-bit units
    ({"avx512f", "avx512_bf16"}, True, False),  # Cooper Lake
    ({"avx512f", "amx_tile", "amx_bf16", "avx512_fp16"}, True, True),  # Sapphire Rapids (this machine's Xeon)
    ({"amx_fp16"}, False, True),
    ({"fp", "asimd", "asimdhp", "fphp"}, False, True),  # aarch64 with FEAT_FP16 only (Neoverse N1)
    ({"fp", "asimd", "bf16", "fphp"}, True, True),  # aarch64 with FEAT_BF16 (Graviton 3)
])
def test_native_16bit_arithmetic_from_injected_flags(flags, bf16, fp16):
    assert cpu_16bit.cpu_16bit_support(flags) == {"bfloat16": bf16, "float16": fp16}
    support = cpu_16bit.cpu_16bit_support(flags)
    assert cpu_16bit.emulated_on_cpu("bfloat16", "cpu", support) is not bf16
    assert not cpu_16bit.emulated_on_cpu("bfloat16", "cuda", support)  # autocast on a GPU is never the CPU's business
    assert not cpu_16bit.emulated_on_cpu(None, "cpu", support)  # a float32 case


def test_env_says_which_16bit_types_are_emulated():
    lines = cpu_16bit_lines({"avx2"})
    assert lines[0].startswith("cpu bfloat16") and "EMULATED" in lines[0] and "avx512_bf16" in lines[0]
    assert "native (avx512_bf16, amx_bf16)" in cpu_16bit_lines({"avx512_bf16", "amx_bf16"})[0]


def test_every_row_records_the_cpu_and_whether_its_autocast_is_emulated(monkeypatch):
    monkeypatch.setattr(cpu_16bit, "cpu_16bit_support", lambda flags=None: {"bfloat16": False, "float16": False})
    row = run_case(Case(TINY, "amp", "eval", 2, "cpu", data="synthetic", warmup=0, steps=1))
    assert row["status"] == "ok", row["message"]
    assert row["emulated_16bit"] is True and row["cpu_bf16_native"] is False and row["cpu_capability"]
    assert run_case(Case(TINY, "baseline", "eval", 2, "cpu", data="synthetic", warmup=0, steps=1),
                    env={})["emulated_16bit"] is False


def test_an_adaptive_row_records_its_options_and_why_it_stopped():
    case = Case(TINY, "baseline", "eval", 2, "cpu", data="synthetic", warmup=0, steps=None, min_steps=3,
                max_time_s=0.5, target_ci_rel=0.5)
    row = run_case(case, env={})
    assert row["status"] == "ok", row["message"]
    assert row["timing_fixed_steps"] is None and row["timing_min_steps"] == 3 and row["timing_max_time_s"] == 0.5
    assert row["timing_stop_reason"] in ("ci_target", "time_budget") and row["measured_steps"] >= 3
    if row["timing_stop_reason"] == "ci_target":
        assert row["measured_steps"] >= 6 and row["timing_ci_rel"] <= 0.5
    fixed = run_case(Case(TINY, "baseline", "eval", 2, "cpu", data="synthetic", warmup=0, steps=4), env={})
    assert fixed["measured_steps"] == 4 and fixed["timing_stop_reason"] == "fixed_steps"
    assert fixed["timing_fixed_steps"] == 4 and fixed["timing_min_steps"] is None


def _captcha(strategy, phase="train", batch=100):
    return Case("captcha_resnet18", strategy, phase, batch, "cpu", data="captcha", warmup=1, steps=None,
                min_steps=1, max_time_s=10.0, target_ci_rel=0.05)


def test_the_note_before_an_emulated_case_gives_the_estimate():
    """The AMD EPYC of captcha_no_bf16: baseline 5.68 s a step at batch 100, amp 15-23x: on the emulated path, the
    strategy's and the baseline's verification steps at batch 4 and one timed step (longer than the 10 s budget)."""
    case = _captcha("amp")
    assert eta.case_steps(case, 85.0) == 1 + 1 + 1 + 3  # verification, warm-up, one timed step, memory pass
    text = eta.emulation_warning(case, "bfloat16", "AMD EPYC", 5681.0, slowdown=(15.0, 23.0))
    low, high = (5.681 * f * 4 / 100 + 5.681 * 4 / 100 + 5.681 * f for f in (15, 23))
    assert "bfloat16" in text and "AMD EPYC" in text and "emulates it in float32" in text and "15.0-23.0x" in text
    assert f"about {eta.duration(low)} to {eta.duration(high)}" in text
    assert "no baseline time yet" in eta.emulation_warning(case, "bfloat16", "AMD EPYC", None, slowdown=(15.0, 23.0))


def test_the_progress_prints_the_note_before_an_emulated_case_starts(monkeypatch):
    monkeypatch.setattr(cpu_16bit, "cpu_16bit_support", lambda flags=None: {"bfloat16": False, "float16": False})
    cases = [_captcha("baseline"), _captcha("amp")]
    estimate = eta.sweep_estimate(cases)
    assert estimate.emulated == {1: "bfloat16"}
    screen = io.StringIO()
    bar = Progress(screen, estimate, cpu="AMD EPYC")
    bar.case(0, 2, cases[0], None)
    bar.case(0, 2, cases[0], {"status": "ok", "step_time_ms_median": 5681.0, "peak_mem_bytes": 1,
                              "matches_baseline": True, "measured_steps": 2, "timing_stop_reason": "time_budget"})
    bar.case(1, 2, cases[1], None)
    lines = screen.getvalue().splitlines()
    assert lines[-2].endswith("amp train bs=100 cpu ...")
    assert lines[-1].startswith("  note: amp autocasts to bfloat16, which this CPU (AMD EPYC)")
    assert "(2 steps, time_budget)" in lines[1]


def test_the_estimate_of_the_time_left_scales_alike_cases():
    cases = [_captcha("baseline", batch=25), _captcha("checkpoint", batch=25), _captcha("baseline"),
             _captcha("checkpoint"), _captcha("amp")]
    estimate = eta.SweepEstimate(cases, emulated={4: "bfloat16"})
    assert estimate.seconds_left() is None
    estimate.finished(0, 10.0, {"status": "ok", "step_time_ms_median": 1000.0})
    estimate.finished(1, 12.0, {"status": "ok", "step_time_ms_median": 1200.0})
    # checkpoint at 100: 4x its time at 25; baseline at 100: 4x; amp at 100: no baseline at 100 yet -> the mean
    assert estimate.seconds_left() == pytest.approx(48 + 40 + 11)
    estimate.finished(2, 40.0, {"status": "ok", "step_time_ms_median": 4000.0})
    low, high = eta.emulated_case_seconds(cases[4], 4000.0)
    assert estimate.seconds_left(running=3, running_for=8.0) == pytest.approx(40 + (low + high) / 2)


def test_the_table_says_which_times_are_emulated(monkeypatch):
    from bench.cli.console import format_table
    from bench.core import results

    monkeypatch.setattr(cpu_16bit, "cpu_16bit_support", lambda flags=None: {"bfloat16": False, "float16": True})
    rows = [run_case(Case(TINY, spec, "eval", 2, "cpu", data="synthetic", warmup=0, steps=1), env={})
            for spec in ("baseline", "amp", "amp:dtype=float16")]
    assert [row["emulated_16bit"] for row in rows] == [False, True, False]
    table = format_table(results.to_frame(rows))
    assert table.splitlines()[-1].startswith("amp: 16-bit autocast that this CPU emulates in float32")


def test_the_header_says_how_long_the_first_case_takes_and_how_to_be_quicker():
    """A CPU sweep's header gives the first case's duration from a calibrated step time, and --quick --batch-size 8
    where that may be over a minute (a first result within a minute)."""
    measured = {4: 0.086, 8: 0.128}  # captcha_resnet18's baseline steps on a 2-thread Xeon, seconds
    step_s = eta.calibrated_step_seconds(Case("captcha_resnet18", "checkpoint", "train", 100, "cpu"),
                                         measure=lambda case: measured[case.batch_size])
    assert step_s(4) == pytest.approx(0.086) and step_s(100) == pytest.approx(0.086 + 96 * 0.0105)
    slow = Case("captcha_resnet18", "baseline", "train", 100, "cpu", warmup=3, steps=None, min_steps=5,
                max_time_s=30.0)
    text, over_a_minute = eta.first_case_note(slow, step_s)
    assert over_a_minute and "will take about 38s to 1m17s" in text and "--quick --batch-size 8" in text
    quick = Case(TINY, "baseline", "train", 2, "cpu", warmup=1, steps=3)
    text, over_a_minute = eta.first_case_note(quick, lambda batch_size: 0.01)
    assert not over_a_minute and "--quick" not in text and "about 0s to 0s" in text
