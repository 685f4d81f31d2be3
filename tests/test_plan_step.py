"""A plan candidate's step (`bench.analysis.plan_step`): its operators counted in the measured step only, and a
candidate stopped once it certainly cannot fit; each checked against the candidate traced to the end, on tiny CUDA
plans predicted on the CPU's fake tensors."""

from __future__ import annotations

import dataclasses

import pytest

from bench.analysis import plan, plan_cost, plan_floor, plan_search, plan_step
from bench.cli import commands_plan
from bench.core import gpus
from bench.core.results import Status
from tests.test_plan import _few_settings

WORKLOAD = "gpt_mini:layers=2:width=64:heads=2:seq_len=128"  # checkpoint and amp each save memory: they combine
BATCH = 8
FIGURES = plan_cost.gpu_figures(gpus.find_gpu("H100 80GB"))
# a search of five candidates (and the settings the case refuses): checkpoint with amp the only combination
FEW = ("checkpoint", "amp:dtype=bfloat16", "bf16_weights")


PAIR = "checkpoint+amp:dtype=bfloat16"


def _request(limit_bytes: int = 2**40, **changes) -> plan.PlanRequest:
    request = plan.PlanRequest(WORKLOAD, "synthetic", BATCH, "cuda", "H100 80GB", limit_bytes, 0,
                               plan_cost.to_json(FIGURES), capability=(9, 0), max_search_s=600)
    return dataclasses.replace(request, **changes)


def _no_floor(monkeypatch) -> None:
    """No combination ruled out by its parameters and optimizer state before it runs (`plan_floor`, whose own tests
    are tests/test_plan_floor.py): at 1 MiB it would rule out the combinations these tests stop in their steps."""
    monkeypatch.setattr(plan_floor, "training_state_bytes", lambda workload: None)


def _to_the_end(monkeypatch) -> None:
    """Every candidate traced to the end, its operators counted in every step (what plan did before plan_step)."""
    evaluate = plan.evaluate
    monkeypatch.setattr(plan_step.MeasuredStepCounter, "__torch_dispatch__",
                        plan_step.OperatorCostCounter.__torch_dispatch__)
    monkeypatch.setattr(plan, "evaluate", lambda request, spec, members, figures, may_stop=False, probe=True:
                        evaluate(request, spec, members, figures))


def _figures(row) -> dict:
    return {k: v for k, v in dict(row).items() if k not in ("limit_bytes", "fits", "eligible", "on_front", "answer")}


LOW = 2**20  # nothing fits: the combination and bf16_weights stop


@pytest.fixture(scope="module")
def searches() -> dict:
    """Three searches of the few settings: "full", every candidate traced to the end with every step's operators
    counted (what plan did before `plan_step`), and as plan runs them, "low" at 1 MiB and "fit" at the judged bytes
    of checkpoint with amp (the answer; bf16_weights stopped)."""
    found = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        _few_settings(monkeypatch, FEW)
        _no_floor(monkeypatch)
        found["low"] = plan_search.search(_request(LOW))
        with pytest.MonkeyPatch.context() as to_the_end:
            _to_the_end(to_the_end)
            found["full"] = plan_search.search(_request(LOW))
        limit = next(r["judged_bytes"] for r in found["full"].rows if r["strategy"] == PAIR)
        found["fit"] = plan_search.search(_request(limit))
    return found


def _by_spec(searched) -> dict:
    return {row["strategy"]: row for row in searched.rows}


def test_counting_the_measured_step_only_changes_no_figure(searches):
    """Every candidate that ran to the end has the figures (operators, time, bytes) of its full trace."""
    full = _by_spec(searches["full"])
    for name in ("low", "fit"):
        ran = [row for row in searches[name].rows if row["status"] == Status.OK.value
               and not plan_step.stopped_over_limit(row)]
        assert len(ran) >= 3 and all(row["step_ops"] and row["est_step_time_ms"] for row in ran)
        for row in ran:
            assert _figures(row) == _figures(full[row["strategy"]]), (name, row["strategy"])


def test_a_combination_stops_only_where_it_cannot_fit_and_says_how_much_it_had_reserved(searches):
    full, low, fit = (_by_spec(searches[name])[PAIR] for name in ("full", "low", "fit"))
    assert fit["fits"] and not plan_step.stopped_over_limit(fit)  # at its own judged bytes it runs to the end
    assert plan_step.stopped_over_limit(low) and not low["fits"] and low["est_step_time_ms"] is None
    reserved = int(low["message"].split(" B, over the limit")[0].rsplit(" ", 1)[1].replace(",", ""))
    assert LOW < reserved <= full["judged_bytes"]  # a bound its full prediction reaches
    assert f"{plan_step.FORWARD} of warm-up step 1" in low["message"]  # stopped before its forward ended


def test_a_setting_whose_ratios_combinations_need_runs_to_the_end_even_over_the_limit(searches):
    """The baseline and the settings that keep what is trained feed the search's combinations: never stopped. One
    that changes what is trained combines only with --allow-different: stopped without it, not with it."""
    low, full = _by_spec(searches["low"]), _by_spec(searches["full"])
    for spec in ("baseline", "checkpoint", "amp:dtype=bfloat16"):
        assert not low[spec]["fits"] and not plan_step.stopped_over_limit(low[spec]), spec
    assert plan_step.stopped_over_limit(low["bf16_weights"]) and low["bf16_weights"]["differs_by_design"]
    allowed = plan.evaluate(_request(LOW, allow_different=True), "bf16_weights", 1, FIGURES, may_stop=True)
    assert _figures(allowed) == _figures(full["bf16_weights"])


def test_a_search_that_stops_candidates_tries_the_same_ones_and_answers_the_same(searches):
    """The same candidates (at the same limit, in the same order), each stopped only where its full trace does not
    fit; the same answer and the same candidates that fit on the front as the full traces judged at that limit."""
    fast, full = searches["low"], searches["full"]
    assert [r["strategy"] for r in fast.rows] == [r["strategy"] for r in full.rows]
    assert {r["strategy"] for r in fast.rows if plan_step.stopped_over_limit(r)} == {"bf16_weights", PAIR}
    assert all(plan.decide([dict(r) for r in found.rows], False) is None for found in (fast, full))
    fit = [dict(r) for r in searches["fit"].rows]
    limit = fit[0]["limit_bytes"]
    judged_there = [dict(r, fits=r["judged_bytes"] is not None and r["judged_bytes"] <= limit) for r in full.rows]
    assert {r["strategy"] for r in fit} == {r["strategy"] for r in judged_there}
    fits_fully = {r["strategy"]: r["fits"] for r in judged_there}
    assert all(not fits_fully[r["strategy"]] for r in fit if plan_step.stopped_over_limit(r))
    answers = [plan.decide(rows, allow_different=False) for rows in (fit, judged_there)]
    assert answers[0]["strategy"] == answers[1]["strategy"] == PAIR
    assert {r["strategy"] for r in fit if r["on_front"] and r["fits"]} == \
        {r["strategy"] for r in judged_there if r["on_front"] and r["fits"]}


def test_the_command_says_which_candidates_it_stopped_and_claims_no_smallest_reachable(searches, tmp_path):
    request, searched = _request(LOW), searches["low"]
    said = commands_plan._nothing_fits(request, searched, tmp_path / "plan.csv")
    assert "no candidate fits" in said and "smallest reachable" not in said
    assert "stopped in their warm-up steps" in said and PAIR in said
    summary = commands_plan._summary(request, "a test limit", searched, 1.0, 1.0, "")
    assert "stopped in their warm-up steps" in summary


# --- on several ranks: every candidate is sharded, and any may stop -----------------------------------------------

SHARDED = ("checkpoint", "fsdp", "zero2")


def _on_two_ranks(limit_bytes: int, known: list) -> plan.PlanRequest:
    return dataclasses.replace(_request(limit_bytes).on_ranks(2), sharded_only=True, known_rows=known,
                               strategies=SHARDED)


@pytest.fixture(scope="module")
def ranked() -> dict:
    """A search on two ranks of fsdp and zero2 with checkpoint (what one rank found known), at 1 MiB ("low")
    and at the judged bytes of checkpoint:segments=all+fsdp traced to the end ("fit"); "full": every candidate at
    1 MiB traced to the end."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _no_floor(monkeypatch)
        one = plan_search.search(dataclasses.replace(_request(LOW), strategies=SHARDED))
    known = [dict(r) for r in one.rows if r["status"] == Status.OK.value and not plan_step.stopped_over_limit(r)]
    found = {"low": plan_search.search(_on_two_ranks(LOW, known))}
    with pytest.MonkeyPatch.context() as to_the_end:
        _to_the_end(to_the_end)
        found["full"] = plan_search.search(_on_two_ranks(LOW, known))
    limit = _by_spec(found["full"])["checkpoint:segments=all+fsdp"]["judged_bytes"]
    found["fit"] = plan_search.search(_on_two_ranks(limit, known))
    return found


@pytest.mark.slow  # in .ci/run's long tests of make test
def test_on_ranks_a_sharded_setting_alone_stops_and_still_combines(ranked):
    low, full = _by_spec(ranked["low"]), _by_spec(ranked["full"])
    for spec in ("fsdp", "zero2"):
        assert plan_step.stopped_over_limit(low[spec]) and not plan_step.stopped_over_limit(full[spec]), spec
    # it combines all the same: every candidate the full search ran is tried, each stopped, and more (a setting
    # stopped promises no saving and no cost, where zero2's full figures on two ranks promised nothing useful)
    assert set(full) <= set(low) and len(full) >= 6
    assert all(plan_step.stopped_over_limit(row) for row in low.values() if row["status"] == Status.OK.value)
    assert all(full[spec]["judged_bytes"] > LOW for spec in full if plan_step.stopped_over_limit(low[spec]))


@pytest.mark.slow  # in .ci/run's long tests of make test
def test_on_ranks_a_stopped_candidate_does_not_fit_and_the_answer_is_the_full_traces(ranked):
    fit, full = ranked["fit"], [dict(r) for r in ranked["full"].rows]
    limit = fit.rows[0]["limit_bytes"]
    judged_there = [dict(r, fits=r["judged_bytes"] is not None and r["judged_bytes"] <= limit) for r in full]
    by_spec = {r["strategy"]: r for r in judged_there}
    stopped = [r for r in fit.rows if plan_step.stopped_over_limit(r)]
    assert stopped
    for row in stopped:  # each over the limit when traced to the end
        to_the_end = by_spec.get(row["strategy"]) or plan.evaluate(_on_two_ranks(limit, []), row["strategy"],
                                                                    row["members"], FIGURES)
        assert to_the_end["judged_bytes"] > limit, row["strategy"]
    ran = [r for r in fit.rows if r["status"] == Status.OK.value and not plan_step.stopped_over_limit(r)]
    assert all(_figures(r) == _figures(by_spec[r["strategy"]]) for r in ran)
    answers = [plan.decide(rows, allow_different=False) for rows in ([dict(r) for r in fit.rows], judged_there)]
    assert answers[0] is not None and answers[0]["strategy"] == answers[1]["strategy"]


@pytest.mark.slow  # in .ci/run's long tests of make test
def test_on_ranks_a_setting_the_one_rank_search_did_not_reach_still_combines(ranked):
    """A one-rank search cut short after its baseline: checkpoint's first setting, never tried alone (it cannot
    run alone on two ranks), combines with the sharded ones all the same, as the combinations of a full one-rank
    search do (neutral ratios: nothing known of it); its later settings wait for a one-rank search that tries them."""
    # as `plan --max-ranks` makes it: its settings' ratios make the sharded candidates (no floor rules them out)
    one = plan_search.search(dataclasses.replace(_request(LOW), strategies=("checkpoint",), max_candidates=1,
                                                 feeds_ranks=True))
    assert [r["strategy"] for r in one.rows if r["status"] == Status.OK.value] == ["baseline"]
    cut_short = plan_search.search(_on_two_ranks(LOW, [dict(r) for r in one.rows]))
    tried = {r["strategy"] for r in cut_short.rows}
    assert {"checkpoint:segments=all+fsdp", "checkpoint:segments=all+zero2", "fsdp:offload=cpu"} <= tried
    assert "checkpoint+fsdp" not in tried and "checkpoint+fsdp" in {r["strategy"] for r in ranked["low"].rows}


def test_a_probe_runs_through_the_first_step_where_the_rest_of_it_costs_less_than_the_replay():
    from bench.analysis import plan_replay
    from bench.run.case import Case, bind_case
    from bench.run.runner import MEMORY_WARMUP_STEPS

    def through_first_step(workload: str, spec: str) -> bool:
        case = Case(workload, spec, "train", 1, "cuda")
        return plan_replay.probes_first_step(case, bind_case(case, 1)[0], MEMORY_WARMUP_STEPS["cuda"])

    # 32 layers alike: 21 layer-steps after the forward against the replay's 3 x 2 + 4 x 2 + 5 x 3 = 29
    assert through_first_step("hf:llama-3.1-8b:seq_len=4096", "checkpoint:segments=all+offload")
    # 80 layers alike: 53 against 29
    assert not through_first_step("hf:llama-3.1-70b:seq_len=4096", "checkpoint:segments=all+offload")
    # 80 layers of two kinds (65 checkpointed, 15 plain): 53 against (3+2) x 2 + (4+2) x 2 + (3+3) x 2 + (5+4) x 3 = 61
    assert through_first_step("hf:llama-3.1-70b:seq_len=4096", "checkpoint+offload")
