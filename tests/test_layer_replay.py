"""Layer replay (bench/analysis/layer_replay.py) gives what the full trace gives, to the byte: the event log it builds
for N layers from traces at 3 and 4 equals the log of a real N-layer trace event for event, and a predict row made by
it has every figure of the row made by tracing every layer (MEMBENCH_FULL_TRACE=1); where a strategy treats layers
differently it is not used, and the row says nothing of it."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from bench.analysis import layer_replay, predict, proof_beside
from bench.measure import layer_alignment, layer_template
from bench.measure.memory import MemoryEvent
from bench.analysis.fake_engine import PredictionMeter, bound_device, tracked_step
from bench.measure import cuda_allocator
from bench.run.case import Case
from bench.run.case import bind_case
from bench.run.runner import MEMORY_WARMUP_STEPS

# a Llama decoder cut to 6 layers (fake tensors: the width costs no time), short sequences
SMALL = "hf:llama-3.2-1b:seq_len=32:layers=6"
FULL_SIZE = "hf:llama-3.1-8b:seq_len=4096"


def _full_trace(case: Case, engine: str = "fake"):
    planned = bind_case(replace(case, device=bound_device(engine)), 1)[0]
    planned.plan(PredictionMeter(case))
    return tracked_step(case, case.strategy, engine, 1, cuda_autocast=True, record_events=True,
                        warmup_steps=MEMORY_WARMUP_STEPS["cuda"], planned=planned)


def test_the_log_built_for_six_layers_is_the_six_layer_trace_event_for_event():
    # bf16_weights replaces the parameters on fake tensors: each must still have its gradient filed as one
    case = Case(SMALL, "bf16_weights+lora+checkpoint:segments=all", "train", 2, "cuda")
    replayed, why = layer_replay.tracked_step_by_layers(case, case.strategy, "fake", MEMORY_WARMUP_STEPS["cuda"],
                                                        None)
    assert why is None, why
    full = _full_trace(case)
    assert replayed.events == layer_replay.measured_log(full.events)
    assert replayed.recompute_plan == full.recompute_plan == "0 1 2 3 4 5"
    by_replay, by_full_trace = cuda_allocator.replay(replayed.events), cuda_allocator.replay(full.events)
    assert by_replay == cuda_allocator.replay(layer_replay.measured_log(full.events))
    for figure in ("max_allocated_bytes", "max_reserved_bytes", "cublas_workspaces", "peak_by_category"):
        assert getattr(by_replay, figure) == getattr(by_full_trace, figure)


def test_a_replayed_row_has_every_figure_of_the_full_trace(monkeypatch):
    case = Case(SMALL, "baseline", "train", 2, "cuda")
    replayed = predict.predict_case(case, engine="fake")
    monkeypatch.setenv(layer_replay.FULL_TRACE_ENV, "1")
    full = predict.predict_case(case, engine="fake")
    assert "layer replay: traced at 3, 4 and 5 layers, the 6-layer log" in replayed["message"]
    assert "layer replay" not in full["message"]
    figures = [name for name in full if name != "message"]
    assert {name: replayed[name] for name in figures} == {name: full[name] for name in figures}
    assert replayed["predicted_bytes"] > 0


def test_a_plan_whose_replay_traces_more_layers_than_the_full_trace_is_traced_in_full():
    case = Case(SMALL, "lora+checkpoint", "train", 2, "cuda")  # segments=auto: 5 layers checkpointed, the last plain
    strategy = bind_case(case, 1)[0]
    assert layer_replay.layer_kinds(strategy, 6) == (5, 1)
    assert "would trace 15 layers, the full trace 6" in layer_replay.why_not_replayable(case, strategy, 1, "fake",
                                                                                       snapshot=False)
    budget = Case(SMALL, "lora+checkpoint:budget=0.5", "train", 2, "cuda")
    assert "budget" in layer_replay.why_not_replayable(budget, bind_case(budget, 1)[0], 1, "fake", snapshot=False)
    for other in (Case(SMALL, "lora", "train", 2, "cpu"), Case("hf:tiny-llama", "lora", "train", 2, "cuda")):
        assert layer_replay.why_not_replayable(other, bind_case(other, 1)[0], 1, "fake", snapshot=False)
    assert layer_replay.why_not_replayable(case, strategy, 1, "fake", snapshot=True)


def test_the_kinds_of_layers_of_checkpoint_plans():
    def kinds(segments: str, layers: int):
        return layer_replay.layer_kinds(bind_case(Case(SMALL, f"checkpoint:segments={segments}", "train", 2, "cuda"),
                                                  1)[0], layers)

    assert kinds("auto", 32) == (25, 7) and kinds("sqrt", 32) == (25, 7) and kinds("32", 32) == (31, 1)
    assert kinds("auto", 80) == (65, 15)
    assert kinds("all", 32) is None and kinds("1", 32) is None
    assert layer_replay.kinds_traced(31, 1) == [(3, 1), (4, 1), (5, 1)]
    # one template over both counts from 3+2, 4+2 and 3+3, proven at 5+4: 26 layers (nested templates took 33)
    assert layer_replay.kinds_traced(65, 15) == [(3, 2), (4, 2), (3, 3), (5, 4)]
    # their layers times the steps each runs (two warm-up steps; the proof's measured step too)
    assert layer_replay.traced_layer_steps(None, 2) == 3 * 2 + 4 * 2 + 5 * 3 == 29
    assert layer_replay.traced_layer_steps((65, 15), 2) == (5 + 6 + 6) * 2 + 9 * 3 == 61
    llama_70b = Case("hf:llama-3.1-70b:seq_len=4096", "lora+checkpoint", "train", 1, "cuda")  # 80 layers: 65+15
    assert layer_replay.why_not_replayable(llama_70b, bind_case(llama_70b, 1)[0], 1, "fake", snapshot=False) is None
    llama_8b = Case(FULL_SIZE, "lora+checkpoint", "train", 1, "cuda")  # 32 layers: 25+7, 26 traced (81%)
    assert layer_replay.why_not_replayable(llama_8b, bind_case(llama_8b, 1)[0], 1, "fake", snapshot=False) is None
    llama_28_layers = Case(f"{FULL_SIZE}:layers=28", "lora+checkpoint", "train", 1, "cuda")  # 28 layers, 26 traced
    assert "would trace 26 layers" in layer_replay.why_not_replayable(
        llama_28_layers, bind_case(llama_28_layers, 1)[0], 1, "fake", snapshot=False)
    compiled = Case(FULL_SIZE, "lora+checkpoint+compile:scope=layers", "train", 1, "cuda")  # compiles per trace
    assert "with compile (each of the four traces compiles" in layer_replay.why_not_replayable(
        compiled, bind_case(compiled, 1)[0], 1, "fake", snapshot=False)


def _operators(stage: str, first: str, layer: int) -> list:
    """A layer's operators (a period is longer than the events the alignment looks ahead, as in a real log)."""
    return [MemoryEvent("op", stage=stage, op=op, module=f"model.layers.{layer}")
            for op in [first] + [f"op{index}.default" for index in range(8)]]


def _two_kinds_log(checkpointed: int, plain: int) -> list:
    """A step's log over checkpointed layers (their activations freed in forward, recomputed in backward) and plain
    ones after them (kept), whose optimizer frees every layer's gradient in order: it names storages of both kinds."""
    events, grads, kept = [], {}, {}

    def alloc(nbytes: int, stage: str, module: str) -> int:
        events.append(MemoryEvent("alloc", len(grads) + len(kept) + len(events) + 1, nbytes, stage, module=module))
        return events[-1].key

    for layer in range(checkpointed + plain):
        op = "checkpoint.default" if layer < checkpointed else "mm.default"
        events += _operators("forward", op, layer)
        kept[layer] = alloc(64, "forward", f"model.layers.{layer}")
        if layer < checkpointed:
            events.append(MemoryEvent("free", kept.pop(layer), stage="forward"))
    for layer in reversed(range(checkpointed + plain)):
        if layer < checkpointed:  # the recompute first
            kept[layer] = alloc(64, "backward", f"model.layers.{layer}")
        events += _operators("backward", "mm_backward.default", layer)
        grads[layer] = alloc(32, "backward", f"model.layers.{layer}.weight")
        events.append(MemoryEvent("free", kept.pop(layer), stage="backward"))
    for layer in range(checkpointed + plain):
        events += [event._replace(module="") for event in _operators("optimizer", "add_.Tensor", layer)]
        events.append(MemoryEvent("free", grads[layer], stage="optimizer"))
    keys = {}  # numbered in the order allocated, as the tracker does
    renumbered = [event._replace(key=keys.setdefault(event.key, len(keys) + 1)) if event.kind == "alloc"
                  else event._replace(key=keys.get(event.key, event.key)) for event in events]
    return renumbered + [MemoryEvent("end")]


def test_a_log_of_two_kinds_of_layers_is_built_from_traces_of_few_of_each(monkeypatch):
    def trace(checkpointed: int, plain: int, repeat_warmup: bool = False):
        return SimpleNamespace(events=_two_kinds_log(checkpointed, plain), offload_host_peak_bytes=None,
                               sdpa_kernel=None, cpu_sdpa_calls=2 * checkpointed + plain,
                               recompute_plan=" ".join(map(str, range(checkpointed))))

    for checkpointed, plain in ((25, 7), (31, 1), (9, 2)):
        steps, events, plan, calls = layer_replay.replayed_kinds(trace, checkpointed, plain)
        assert events == _two_kinds_log(checkpointed, plain)
        assert plan == " ".join(map(str, range(checkpointed))) and calls == 2 * checkpointed + plain
        assert [len(step.events) for step in steps] == [len(_two_kinds_log(*n))
                                                       for n in layer_replay.kinds_traced(checkpointed, plain)]
    # the optimizer frees the gradients of both kinds in one run: without naming them by layer, no template
    monkeypatch.setattr(layer_template, "by_layer_model", lambda members: None)
    with pytest.raises(layer_template.NoReplay):
        layer_replay.replayed_kinds(trace, 25, 7)


@pytest.mark.parametrize("workload, spec, plan", [
    # segments=auto over 7 layers: 5 checkpointed, each alone, and 2 plain (kept as they are, the others varied)
    ("hf:llama-3.2-1b:seq_len=32:layers=7", "lora+checkpoint", "0 1 2 3 4"),
    # segments=3 over 11 layers: 6 checkpointed, each alone, and 5 plain; the template from 3+2, 4+2 and 3+3 layers,
    # proven at 5+4, makes the 6+5-layer log (past the proof in both counts)
    ("hf:llama-3.2-1b:seq_len=32:layers=11", "lora+checkpoint:segments=3", "0 1 2 3 4 5"),
])
def test_a_plan_of_checkpointed_then_plain_layers_replayed_to_the_byte(workload, spec, plan):
    case = Case(workload, spec, "train", 1, "cuda")
    replayed, why = layer_replay.tracked_step_by_layers(case, case.strategy, "fake", MEMORY_WARMUP_STEPS["cuda"],
                                                        None)
    assert why is None, why
    full = _full_trace(case)
    assert replayed.events == layer_replay.measured_log(full.events)
    assert replayed.recompute_plan == full.recompute_plan == plan
    assert replayed.cpu_sdpa_calls == full.cpu_sdpa_calls > 0


@pytest.mark.slow
def test_many_plain_layers_replayed_to_the_byte():
    # segments=2 over 8 layers: 4 checkpointed and 4 plain, both varied (templates over the plain layers at 3 and 4
    # checkpointed ones, then over the checkpointed ones)
    case = Case("hf:llama-3.2-1b:seq_len=32:layers=8", "bf16_weights+qlora+checkpoint:segments=2", "train", 1, "cuda")
    replayed, why = layer_replay.tracked_step_by_layers(case, case.strategy, "fake", MEMORY_WARMUP_STEPS["cuda"],
                                                        None)
    assert why is None, why
    full = _full_trace(case)
    assert replayed.events == layer_replay.measured_log(full.events)
    assert replayed.recompute_plan == full.recompute_plan == "0 1 2 3"


@pytest.mark.slow
def test_compiled_layers_replay_to_the_byte_past_dynamos_recompile_limit():
    # torch._dynamo warns that it hit its recompile limit (8) on these layers: at 12 layers, past it, the log built
    # from 3 and 4 must still be the full trace's (it was in a fresh process as well, 2026-11-28)
    case = Case("hf:llama-3.2-1b:seq_len=32:layers=12", "lora+checkpoint:segments=all+compile:scope=layers:loss=true",
                "train", 1, "cuda")
    full = _full_trace(case)
    replayed, why = layer_replay.tracked_step_by_layers(case, case.strategy, "fake", MEMORY_WARMUP_STEPS["cuda"],
                                                        None)
    assert why is None, why
    assert replayed.events == layer_replay.measured_log(full.events)


@pytest.mark.slow
def test_a_row_of_a_plan_with_one_plain_layer_has_every_figure_of_the_full_trace(monkeypatch):
    # 23 checkpointed layers and 1 plain: 15 layers traced, at most 2/3 of the full trace's 24
    case = Case("hf:llama-3.1-8b:seq_len=32:layers=24", "lora+checkpoint:segments=24", "train", 2, "cuda")
    replayed = predict.predict_case(case, engine="fake")
    monkeypatch.setenv(layer_replay.FULL_TRACE_ENV, "1")
    full = predict.predict_case(case, engine="fake")
    assert "layer replay: traced at 3+1, 4+1, 5+1 checkpointed+plain layers, the 23+1-layer log" in replayed["message"]
    figures = [name for name in full if name != "message"]
    assert {name: replayed[name] for name in figures} == {name: full[name] for name in figures}


@pytest.mark.slow
def test_a_row_of_a_plan_of_many_plain_layers_says_which_traces_made_it_and_has_every_figure_of_the_full_trace(
        monkeypatch):
    # 6 checkpointed and 3 plain layers: 26 layers traced, more than the 9 traced in full, so the share is lifted
    monkeypatch.setattr(layer_replay, "KINDS_MOST_TRACED_SHARE", 3)
    case = Case("hf:llama-3.2-1b:seq_len=32:layers=9", "bf16_weights+qlora+checkpoint:segments=3", "train", 1, "cuda")
    replayed = predict.predict_case(case, engine="fake")
    monkeypatch.setenv(layer_replay.FULL_TRACE_ENV, "1")
    full = predict.predict_case(case, engine="fake")
    assert ("layer replay: traced at 3+2, 4+2, 3+3, 5+4 checkpointed+plain layers, the 6+3-layer log built from all "
            "but the last") in replayed["message"]
    assert "layer replay" not in full["message"]
    figures = [name for name in full if name != "message"]
    assert {name: replayed[name] for name in figures} == {name: full[name] for name in figures}
    assert replayed["predicted_bytes"] > 0


def test_the_full_trace_is_forced_by_the_environment(monkeypatch):
    case = Case(SMALL, "lora", "train", 2, "cuda")
    strategy = bind_case(case, 1)[0]
    assert layer_replay.why_not_replayable(case, strategy, 1, "fake", snapshot=False) is None
    monkeypatch.setenv(layer_replay.FULL_TRACE_ENV, "1")
    assert layer_replay.FULL_TRACE_ENV in layer_replay.why_not_replayable(case, strategy, 1, "fake", snapshot=False)


def test_a_log_that_does_not_grow_by_whole_layers_makes_no_template():
    def log(layers: int, extra: int = 0) -> list:
        events = [MemoryEvent("alloc", 1, 100, "setup")]
        for layer in range(layers):
            events += [MemoryEvent("op", stage="forward", op="mm.default"),
                       MemoryEvent("alloc", layer + 2, 64, "forward", module=f"model.layers.{layer}")]
        events += [MemoryEvent("alloc", layers + 2 + i, 8 * (i + 1), "forward") for i in range(extra)]
        return events + [MemoryEvent("end")]

    template = layer_template.LayerTemplate(log(3), log(4), 3)
    assert template.events(9) == log(9)
    with pytest.raises(layer_template.NoReplay):
        layer_template.LayerTemplate(log(3), log(4, extra=3), 3)


@pytest.mark.slow
@pytest.mark.parametrize("spec, note", [
    ("lora+checkpoint:segments=all", "traced at 3, 4 and 5 layers, the 32-layer log"),
    ("bf16_weights+qlora+checkpoint:segments=all", "traced at 3, 4 and 5 layers, the 32-layer log"),
    ("lora+checkpoint:segments=32", "traced at 3+1, 4+1, 5+1 checkpointed+plain layers, the 31+1-layer log"),
])
def test_full_size_llama_rows_by_layer_replay_equal_the_full_trace(spec, note, monkeypatch):
    case = Case(FULL_SIZE, spec, "train", 1, "cuda")
    (replayed,) = predict.predict_cases([case])
    monkeypatch.setenv(layer_replay.FULL_TRACE_ENV, "1")
    (full,) = predict.predict_cases([case])
    assert f"layer replay: {note}" in replayed["message"]
    figures = [name for name in full if name != "message"]
    assert {name: replayed[name] for name in figures} == {name: full[name] for name in figures}


def test_alignment_finds_a_period_whose_first_event_recurs_inside_it():
    # only lengths back to an earlier occurrence of the block's first event are compared whole: here that event
    # recurs three times in a period, and runs of it repeat (lengths 1 and 2 repeat, but the smaller log does not
    # go on after them), so the one period of 8 must still be found, and nowhere else
    period = [1, 1, 2, 1, 3, 1, 1, 4]
    smaller, larger = [0] + period * 3 + [9, 1, 1], [0] + period * 4 + [9, 1, 1, 1]
    assert layer_template.align(smaller, larger) == [(25, 8), (36, 1)]
    with pytest.raises(layer_template.NoReplay):
        layer_template.align(smaller, [0] + period * 4 + [1, 9, 1, 1])


def _expanded(base: list[int], runs: list, extra: tuple[int, int]) -> list[int]:
    """The base log's tokens with each run grown by its kinds' extra layers."""
    out, position = [], 0
    for run in runs:
        out += base[position:run.start]
        periods = run.periods + sum(grows * more for grows, more in zip(run.growth, extra))
        out += base[run.start:run.start + run.length] * periods
        position = run.start + run.length * run.periods
    return out + base[position:]


@pytest.mark.parametrize("head, tail", [([0], [9]), ([0, 3, 4], [9]), ([0], [3, 4, 9])])
def test_runs_of_two_kinds_that_share_the_events_where_they_meet_are_cut_apart(head, tail):
    # each checkpointed layer is u then v, each plain one v then w (a layer ends and the next begins with the same
    # events, as an FSDP rank's gathers): the runs each kind's alignment finds overlap by v; turned or shortened
    # by a period, they must make the log at any counts
    u, v, w = [1, 2], [3, 4], [5, 6]

    def log(checkpointed: int, plain: int) -> list[int]:
        return head + (u + v) * (checkpointed - 1) + u + (v + w) * plain + tail

    runs = layer_alignment.kinds_runs(log(3, 2), [log(4, 2), log(3, 3)])
    assert all(a.start + a.length * a.periods <= b.start for a, b in zip(runs, runs[1:]))
    for checkpointed, plain in ((3, 2), (4, 2), (3, 3), (25, 7)):
        assert _expanded(log(3, 2), runs, (checkpointed - 3, plain - 2)) == log(checkpointed, plain)


@pytest.mark.parametrize("spec, replays", [
    ("hf:llama-3.1-8b:seq_len=4096", True),  # its preset's 32 layers
    ("hf:llama-3.1-8b:layers=5", False),
    ("hf:llama-3.2-1b:seq_len=32:layers=6", True),
    ("hf:tiny-llama", False),  # membench's own small preset
    ("hf:meta-llama/Llama-3.1-8B:seq_len=4096", True),  # a Hub id: its layers are not in the spec
    ("gpt_mini", False),
    ("captcha_resnet18", False),
])
def test_whether_a_workload_might_replay_is_read_from_its_spec_alone(spec, replays):
    # `proof_beside.stand_by` forks its worker only for these, before anything reads the workload
    assert layer_replay.might_replay(spec) is replays


def test_a_log_made_while_the_proof_runs_beside_is_made_at_once_and_fails_where_it_is_asked_for():
    # with the proof in the worker this process makes the logs while it would only wait; without, when asked for
    made = []

    def make(*counts):
        made.append(counts)
        if counts == (9,):
            raise layer_replay.NoReplay("no log at 9")
        return [MemoryEvent("alloc", 1, 512 * counts[0])]

    later = proof_beside.made_while_waiting(None, make, 5)
    assert made == []
    assert later() == [MemoryEvent("alloc", 1, 2560)] and made == [(5,)]
    beside = object()  # a Future of the worker's proof
    now, failing = proof_beside.made_while_waiting(beside, make, 6), proof_beside.made_while_waiting(beside, make, 9)
    assert made == [(5,), (6,), (9,)]
    assert now() == [MemoryEvent("alloc", 1, 3072)]
    with pytest.raises(layer_replay.NoReplay, match="no log at 9"):
        failing()


def test_a_step_the_worker_sends_arrives_as_it_left():
    from bench.analysis import proof_beside
    from bench.analysis.fake_engine import TrackedStep

    events = [MemoryEvent("alloc", 1, 1024, "forward", "aten.mm.default", "model.layers.0.mlp", "activations"),
              MemoryEvent("op", op="aten.mm.default"), MemoryEvent("free", 1, 1024, "backward"), MemoryEvent("end")]
    step = TrackedStep(1024, events, "fake-cuda", None, {"activations": 1024}, "math", 0, "0 1 2", None)
    arrived = proof_beside._unpacked(proof_beside._packed(step))
    assert arrived == step
    assert all(type(event) is MemoryEvent for event in arrived.events)
    assert proof_beside._unpacked(proof_beside._packed(replace(step, events=None))).events is None
