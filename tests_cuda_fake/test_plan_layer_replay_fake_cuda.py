"""A plan candidate by layer replay (`bench.analysis.plan.evaluate`, `bench.analysis.layer_replay`): its row, its
memory from the replayed log and its time from the operator totals extrapolated from the small traces, has every
figure of the row made by tracing every layer (MEMBENCH_FULL_TRACE=1); totals that the proof trace does not confirm
send the candidate to the full trace."""

from __future__ import annotations

import math

import pytest

from bench.analysis import layer_replay, layer_replay_ranks, plan, plan_cost, plan_replay, plan_step
from bench.core import gpus
from bench.measure.op_cost import COLLECTIVE, MATMUL, MEMORY, OpCost

from .conftest import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

WORKLOAD = "hf:llama-3.2-1b:seq_len=32:layers=7"  # traced at 3, 4 and 5 layers
FIGURES = plan_cost.gpu_figures(gpus.find_gpu("H100 80GB"))
TIME_COLUMNS = ("est_step_time_ms", "est_comm_time_ms")


def _request(ranks: int = 1, limit_bytes: int = 2**40, **changes) -> plan.PlanRequest:
    return plan.PlanRequest(WORKLOAD, "synthetic", 3 if ranks > 1 else 2, "cuda", "H100 80GB", limit_bytes,
                            524288000, plan_cost.to_json(FIGURES), ranks=ranks, capability=(9, 0), max_search_s=600,
                            **changes)


@pytest.fixture(autouse=True)
def _no_refusal_remembered():
    """Each test finds its own refusals (a refusal is remembered per model and strategy)."""
    for refused in (plan_replay.REPLAY_REFUSED, layer_replay._REFUSED, layer_replay_ranks._REFUSED):
        refused.clear()
    yield
    for refused in (plan_replay.REPLAY_REFUSED, layer_replay._REFUSED, layer_replay_ranks._REFUSED):
        refused.clear()


@pytest.mark.parametrize("spec, ranks", [("baseline", 1), ("checkpoint:segments=all", 1),
                                         # of 3 ranks, 0 and 2 traced (the last holds smaller chunks)
                                         ("fsdp+checkpoint:segments=all", 3),
                                         # a strategy that shards nothing, planned on 3 ranks (`plan --ranks 3`)
                                         ("checkpoint:segments=all", 3)])
def test_a_candidate_by_layer_replay_has_every_figure_of_the_full_trace(spec, ranks, monkeypatch):
    members = len(spec.split("+")) if spec != "baseline" else 0
    replayed = plan.evaluate(_request(ranks), spec, members, FIGURES, may_stop=True)
    monkeypatch.setenv(layer_replay.FULL_TRACE_ENV, "1")
    full = plan.evaluate(_request(ranks), spec, members, FIGURES, may_stop=True)
    assert replayed["status"] == full["status"] == "ok", (replayed["message"], full["message"])
    assert "layer replay: traced at 3, 4 and 5 layers, the 7-layer log" in replayed["message"]
    assert "operator totals and time extrapolated" in replayed["message"]
    assert "layer replay" not in full["message"]
    assert replayed["step_ops"] > 0 and replayed["est_step_time_ms"] > 0
    if ranks > 1 and "fsdp" in spec:
        assert replayed["step_collective_bytes"] > 0 and replayed["est_comm_time_ms"] > 0
    exact = [name for name in full if name != "message" and name not in TIME_COLUMNS]
    assert {name: replayed[name] for name in exact} == {name: full[name] for name in exact}
    for name in TIME_COLUMNS:
        assert math.isclose(replayed[name], full[name], rel_tol=1e-9, abs_tol=0.0), name


@pytest.mark.parametrize("over_limit", [True, False])
def test_a_candidate_that_may_stop_stops_at_full_size_or_is_replayed(over_limit, monkeypatch):
    # every candidate may stop (as on several ranks); its weights alone are over a limit of 100 MiB past the context
    request = _request(limit_bytes=524288000 + (100 * 2**20 if over_limit else 2**40), sharded_only=True)
    probed = plan.evaluate(request, "checkpoint:segments=all", 1, FIGURES, may_stop=True)
    monkeypatch.setenv(layer_replay.FULL_TRACE_ENV, "1")
    full = plan.evaluate(request, "checkpoint:segments=all", 1, FIGURES, may_stop=True)
    if over_limit:  # stopped in its full-size forward, as the full trace stops
        assert probed["message"].startswith("does not fit (stopped early): in the forward"), probed["message"]
        assert probed == full
    else:  # its first step got under the limit to its end: replayed, with every figure
        assert probed["message"].startswith("layer replay: traced at 3, 4 and 5 layers"), probed["message"]
        exact = [name for name in full if name != "message" and name not in TIME_COLUMNS]
        assert {name: probed[name] for name in exact} == {name: full[name] for name in exact}


@pytest.mark.parametrize("limit_gib, where", [(5, "at the start of the optimizer step of warm-up step 1"),
                                               (9, "at the end of warm-up step 1")])
def test_a_candidate_over_the_limit_only_after_its_forward_stops_in_its_first_step(limit_gib, where, monkeypatch):
    # 7 layers: the rest of the first step costs less than the replay's traces (`plan_replay.probes_first_step`), so
    # the probe goes on past the forward, which fits, and stops where the full trace that may stop stops: once the
    # gradients (5 GiB), or the optimizer's moments (9 GiB), are over the limit
    request = _request(limit_bytes=524288000 + limit_gib * 2**30, sharded_only=True)
    probed = plan.evaluate(request, "checkpoint:segments=all", 1, FIGURES, may_stop=True)
    monkeypatch.setenv(layer_replay.FULL_TRACE_ENV, "1")
    full = plan.evaluate(request, "checkpoint:segments=all", 1, FIGURES, may_stop=True)
    assert probed["message"].startswith(f"does not fit (stopped early): {where}"), probed["message"]
    assert probed == full


def test_a_stopped_candidate_whose_replay_was_refused_says_why_it_was_traced_whole():
    request = _request(limit_bytes=524288000 + 9 * 2**30, sharded_only=True)
    spec = "checkpoint:segments=all"
    plan_replay.REPLAY_REFUSED[plan_replay._replay_key(request.case(spec), spec, "fake-cuda", request)] = "a reason"
    row = plan.evaluate(request, spec, 1, FIGURES, may_stop=True)
    assert row["message"].startswith("does not fit (stopped early): at the end of warm-up step 1"), row["message"]
    assert row["message"].endswith("; layer replay refused (a reason, found on an earlier candidate of this model "
                                   "and strategy): every layer traced"), row["message"]
    assert plan_step.stopped_over_limit(row) and row["judged_bytes"] is None


def test_a_candidate_not_probed_is_replayed_with_every_figure_even_over_the_limit(monkeypatch):
    # the search's combinations that promise to fit skip the look at their full-size forward (probe=False): one that
    # does not fit after all is not stopped but replayed, with the figures of the full trace that does not stop
    request = _request(limit_bytes=524288000 + 100 * 2**20, sharded_only=True)
    unprobed = plan.evaluate(request, "checkpoint:segments=all", 1, FIGURES, may_stop=True, probe=False)
    monkeypatch.setenv(layer_replay.FULL_TRACE_ENV, "1")
    full = plan.evaluate(request, "checkpoint:segments=all", 1, FIGURES)
    assert unprobed["message"].startswith("layer replay: traced at 3, 4 and 5 layers"), unprobed["message"]
    assert unprobed["fits"] is False and unprobed["judged_bytes"] > request.limit_bytes
    exact = [name for name in full if name != "message" and name not in TIME_COLUMNS]
    assert {name: unprobed[name] for name in exact} == {name: full[name] for name in exact}


def test_totals_the_proof_trace_does_not_confirm_send_the_candidate_to_the_full_trace(monkeypatch):
    # one operator more in the 5-layer trace than the 3- and 4-layer ones make for it: not affine in the layers
    counted = plan_replay._trace_totals

    def one_more_at_five_layers(ops, figures, gpus_per_node):
        totals = counted(ops, figures, gpus_per_node)
        return {**totals, "ops": totals["ops"] + 1} if traced[0] == 2 else totals

    traced = [-1]

    def counting(ops, figures, gpus_per_node):
        traced[0] += 1
        return one_more_at_five_layers(ops, figures, gpus_per_node)

    monkeypatch.setattr(plan_replay, "_trace_totals", counting)
    row = plan.evaluate(_request(), "baseline", 0, FIGURES)
    monkeypatch.setattr(plan_replay, "_trace_totals", counted)
    monkeypatch.setenv(layer_replay.FULL_TRACE_ENV, "1")
    full = plan.evaluate(_request(), "baseline", 0, FIGURES)
    assert row["status"] == "ok"
    assert "layer replay refused (the operators' ops made for 5+0 layers" in row["message"]
    assert "every layer traced" in row["message"]
    assert row["step_ops"] == full["step_ops"] and row["judged_bytes"] == full["judged_bytes"]


class _Counted:
    """A trace's `MeasuredStepCounter` with its steps' operators: a warm-up step, then the measured one, run."""

    def __init__(self, ops):
        self.steps = [[], ops]
        self.repeats_last_warmup = False


def _ops(layers: int, proof_extra: int = 0) -> list[OpCost]:
    """A step of `layers` layers: a fixed head, two operators a layer, an optimizer operator growing with them."""
    layer = [OpCost(MATMUL, "bfloat16", 4_000_000, 3_000), OpCost(MEMORY, "float32", 0, 5_000)]
    return ([OpCost(MATMUL, "bfloat16", 9_000_000, 7_000)] + layer * layers
            + [OpCost(MEMORY, "float32", 0, 11_000 * layers + 13 + proof_extra),
               OpCost(COLLECTIVE, "float32", 0, 64 * layers, "all_reduce", (0,))])


def test_the_totals_at_n_layers_are_those_of_the_step_at_n_layers():
    counters = {(3, 0): _Counted(_ops(3)), (4, 0): _Counted(_ops(4)), (5, 0): _Counted(_ops(5))}
    columns = plan_replay._extrapolated_time(counters, (80, 0), FIGURES, 8, 1)
    ops = _ops(80)
    assert columns["step_ops"] == len(ops) == 1 + 2 * 80 + 2
    assert columns["step_moved_bytes"] == sum(op.bytes for op in ops if op.kind != COLLECTIVE)
    assert columns["step_collective_bytes"] == 64 * 80
    assert math.isclose(columns["est_step_time_ms"], FIGURES.seconds(ops) * 1e3, rel_tol=1e-9)
    # two kinds of layers: the slopes of each from the traces one layer apart in it
    counters = {(3, 2): _Counted(_ops(3 + 2)), (4, 2): _Counted(_ops(4 + 2)), (3, 3): _Counted(_ops(3 + 3)),
                (5, 4): _Counted(_ops(5 + 4))}
    assert plan_replay._extrapolated_time(counters, (65, 15), FIGURES, 8, 1)["step_ops"] == 1 + 2 * 80 + 2


def test_a_proof_trace_off_by_one_byte_is_refused():
    counters = {(3, 0): _Counted(_ops(3)), (4, 0): _Counted(_ops(4)), (5, 0): _Counted(_ops(5, proof_extra=1))}
    with pytest.raises(plan_replay._NotAffine, match="bytes made for 5\\+0 layers"):
        plan_replay._extrapolated_time(counters, (80, 0), FIGURES, 8, 1)
