"""The runner: every column filled, failures as rows, verification against the baseline."""

import contextlib
import gc
from dataclasses import replace

import pytest
import torch

from bench.core import results
from bench.core.errors import Unsupported
from bench.run.case import Case, bind_case
from bench.run.runner import memory_pass, run_case, run_cases
from bench.run.verify import _baseline_snapshot
from strategies import STRATEGIES, Strategy, parse_strategy

CASE = Case("captcha_resnet18", "baseline", "train", 2, "cpu", data="synthetic", warmup=0, steps=2)


def test_run_case_fills_every_column():
    row = run_case(CASE)
    row["run_id"] = "test"
    frame = results.to_frame([row])
    own = set(results.STRATEGY_COLUMNS)  # filled only by the strategies that measure them
    own |= {"rank_peak_max_bytes", "rank_peak_min_bytes"}  # sharded cases only
    # a fixed count of 2 steps: adaptive timing's options do not apply, and no 95% interval exists below 6 steps
    own |= {"timing_min_steps", "timing_max_time_s", "timing_target_ci_rel", "timing_ci_rel"}
    core = [c for c in results.COLUMNS if c not in ("peak_reserved_bytes", "message", "strategy_settings") and c not in own]
    missing = [c for c in core if frame[c].isna().any()]
    assert missing == []
    assert row["status"] == "ok" and row["matches_baseline"] and row["loss_rel_diff"] == 0.0
    assert frame[sorted(own - set(results.STRATEGY_COLUMNS))].isna().all().all()


def test_a_failing_case_becomes_a_row_and_the_run_goes_on(tmp_path, temporary_strategy):
    @temporary_strategy
    class Exploding(Strategy):
        name = "test_exploding"

        def forward(self):
            raise RuntimeError("boom")

    @temporary_strategy
    class Oom(Strategy):
        name = "test_oom"

        def forward(self):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    @temporary_strategy
    class EvalOnly(Strategy):
        name = "test_eval_only"
        phases = ("eval",)

    cases = [CASE] + [Case(CASE.workload, s, "train", 2, "cpu", "synthetic", 0, 1)
                      for s in ("test_exploding", "test_oom", "test_eval_only", "baseline")]
    out = tmp_path / "run.csv"
    rows = run_cases(cases, out)
    assert [r["status"] for r in rows] == ["ok", "error", "oom", "unsupported", "ok"]
    assert "boom" in rows[1]["message"] and "eval" in rows[3]["message"]
    assert len(results.read_results(out)) == 5


def test_results_file_is_rewritten_after_every_case(tmp_path, temporary_strategy):
    seen = []

    @temporary_strategy
    class Peek(Strategy):
        name = "test_peek"

        def check(self, context):
            seen.append(len(results.read_results(out)))
            raise Unsupported("only looks")

    out = tmp_path / "run.csv"
    run_cases([CASE, Case(CASE.workload, "test_peek", "train", 2, "cpu", "synthetic", 0, 1)], out)
    assert seen == [1]  # the first case was on disk before the second started


def test_a_strategy_that_changes_the_result_is_reported_as_a_mismatch(temporary_strategy):
    @temporary_strategy
    class Halved(Strategy):
        name = "test_halved_loss"

        def backward(self, loss):
            (loss * 0.5).backward()

    row = run_case(Case(CASE.workload, "test_halved_loss", "train", 2, "cpu", "synthetic", 0, 1))
    assert row["status"] == "ok" and row["matches_baseline"] is False
    assert row["max_grad_rel_diff"] == pytest.approx(0.5, rel=1e-3)


def test_memory_pass_counts_the_steady_state_step():
    stats = memory_pass(CASE, parse_strategy("baseline"))
    params = 11_242_704 * 4
    # Parameters, Adam's two moments and the gradients are all live at the training peak.
    assert stats["peak_mem_bytes"] > 3 * params
    assert stats["peak_stage"] in ("backward", "optimizer")
    assert stats["memory_method"] == "cpu_live_tensor_bytes"


@pytest.mark.parametrize("collected_in_step", [False, True], ids=["collector-idle", "collector-runs-in-step"])
@pytest.mark.parametrize("count", ["live_tensors", "allocator_events"])
def test_the_warm_ups_reference_cycles_are_freed_before_the_measured_step(temporary_strategy, count,
                                                                          collected_in_step):
    """A reference cycle the warm-up leaves (torch.compile's tracing leaves some, holding the tensors it traced) is
    freed before the measured step, whenever Python's collector would have run (not at all, or in the step's
    forward): neither counted in the peak nor freed inside the step."""
    @temporary_strategy
    class Counted(Strategy):
        name = "test_counted"
        cpu_memory_count = count

    @temporary_strategy
    class LeavesACycle(Counted):
        name = "test_leaves_a_cycle"

        @contextlib.contextmanager
        def forward(self):
            if collected_in_step:
                gc.collect()
            yield

        def end_step(self, kept):
            super().end_step(kept)
            if not getattr(self, "_left", False):  # the warm-up step's garbage: a cycle holding 1 MiB
                cycle = {"tensor": torch.ones(2**18)}
                cycle["self"] = cycle
                self._left = True

    case = Case("deep_mlp:layers=24:width=8", "test_counted", "train", 8, "cpu", data="synthetic", warmup=0, steps=1)
    was_enabled = gc.isenabled()
    gc.disable()  # the collector runs only where membench runs it
    try:
        plain = memory_pass(case, parse_strategy("test_counted"))["peak_mem_bytes"]
        leaving = memory_pass(replace(case, strategy="test_leaves_a_cycle"), parse_strategy("test_leaves_a_cycle"))
    finally:
        if was_enabled:
            gc.enable()
    assert leaving["peak_mem_bytes"] == plain


def test_registry_rejects_duplicates():
    with pytest.raises(ValueError, match="duplicate strategy name 'baseline'"):
        STRATEGIES.register(type("Again", (Strategy,), {"name": "baseline"}))


def test_a_mismatch_names_each_failed_check_its_measured_difference_and_its_tolerance():
    """Compare's `message`: only the checks that failed, a NaN difference failing as well."""
    import torch

    from bench.run.verify import Snapshot, compare
    from strategies import Tolerance

    class Strict:
        tolerance = Tolerance(loss_rtol=1e-3)

    one = torch.ones(4)
    reference = Snapshot(1.0, [one], {"w": one, "b": one}, {}, {"w": one, "b": one})
    result = Snapshot(1.01, [one], {"w": one * 2, "b": None}, {}, {"w": one, "b": one * float("nan")})
    columns = compare(result, reference, Strict())
    assert columns["matches_baseline"] is False
    assert columns["message"] == ("differs from the baseline: loss rel diff 0.01 > loss_rtol 0.001; gradient rel diff "
                                  "1 > grad_rtol 0.0001; weights after one step rel diff nan > step_rtol 0.0001; 1 "
                                  "parameter(s) got no gradient where the baseline's did")
    assert "message" not in compare(reference, reference, Strict())


def test_on_a_nondeterministic_device_the_verdict_allows_ten_times_the_baselines_own_difference(monkeypatch):
    """On CUDA the baseline differs from a second run of itself (an H200: 1.5e-4 in a gradient of captcha, from
    cuDNN's atomics); a difference within 10x that noise matches, and the row says it was judged so; a difference
    beyond it does not; on the CPU no second baseline runs and the exact tolerance stands."""
    import torch

    from bench.run import verify as verify_module
    from bench.run.verify import DeviceNoise, Snapshot, compare, device_noise
    from strategies import Tolerance

    class Exact:
        tolerance = Tolerance()

    one = torch.ones(4)
    reference = Snapshot(1.0, [one], {"w": one}, {}, {"w": one})
    off_by = lambda rel: Snapshot(1.0, [one], {"w": one * (1 + rel)}, {}, {"w": one})  # noqa: E731
    noise = DeviceNoise(grad=1.5e-4)
    assert noise.widen(Tolerance()).grad_rtol == pytest.approx(1.5e-3)
    assert DeviceNoise().widen(Tolerance()) == Tolerance()
    assert compare(off_by(1e-3), reference, Exact())["matches_baseline"] is False
    assert compare(off_by(1e-3), reference, Exact(), noise)["matches_baseline"] is True
    assert compare(off_by(2e-3), reference, Exact(), noise)["matches_baseline"] is False
    assert device_noise(Case("captcha_resnet18", "baseline", "train", 2, "cpu")) == DeviceNoise()

    # verify() itself: the strategy's snapshot off by 1e-3, the baseline's exact, the device's noise patched in
    monkeypatch.setattr(verify_module, "snapshot", lambda case, strategy: off_by(1e-3))
    monkeypatch.setattr(verify_module, "baseline_snapshot", lambda case: reference)
    monkeypatch.setattr(verify_module, "device_noise", lambda case: noise)
    case = Case("captcha_resnet18", "inplace_relu", "train", 2, "cpu")
    columns = verify_module.verify(case, bind_case(case)[0])
    assert columns["matches_baseline"] is True
    assert "10x the baseline's own run-to-run difference on this device (gradient 0.00015)" in columns["message"]


def _live_tensor_bytes() -> int:
    """Bytes of every distinct CPU storage that a Python object still refers to."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_an_in_process_sweep_keeps_nothing_of_a_finished_case():
    # the baseline's snapshot (gradients and stepped weights) is kept once for all the strategies compared with it;
    # it was kept once per strategy, and a sweep of 8 GiB cases of a 1B-parameter model grew by 3 GiB a case
    cases = [Case("deep_mlp:layers=20:width=64", spec, "train", 4, "cpu", warmup=0, steps=1)
             for spec in ("baseline", "checkpoint", "amp", "checkpoint+amp", "selective_checkpoint")]
    _baseline_snapshot.cache_clear()  # earlier tests' snapshots would leave the cache as these cases run
    run_case(cases[0])
    after_first = _live_tensor_bytes()
    for case in cases[1:]:
        assert run_case(case)["status"] == "ok"
    assert _live_tensor_bytes() <= after_first  # less where a cache let go of an earlier test's tensors
