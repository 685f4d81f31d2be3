"""Layer replay: the event log of a step of an N-layer decoder stack built from the logs of the same step traced at
a few layers (k and k+1), proven equal to a real trace at k+2 before it is trusted.

How the log at N layers is built from the logs at k and k+1 is bench.measure.layer_template's (`LayerTemplate`);
this module chooses the cases it applies to, traces the step at those layer counts and proves the result.

A checkpoint plan of checkpointed layers then plain ones is replayed alike (`replayed_kinds`): from the step at c
checkpointed and p plain layers and at one layer more of each kind, proven at two more of each.

Nothing is trusted unproven: the template must rebuild both logs it was made from, and the log it makes for k+2
layers must equal a real trace at k+2 event for event and byte for byte (`tracked_step_by_layers`); otherwise the
full trace runs and the row says why. MEMBENCH_FULL_TRACE=1 always runs the full trace.
"""

from __future__ import annotations

import re

from bench.analysis import proof_beside
from bench.core import job_environment
from bench.measure.exact_affine import NotWhole, evaluate, solve
from bench.measure.layer_template import LayerTemplate, NoReplay
from bench.measure.memory import MemoryEvent
from bench.measure.replay_log import live_peak, measured_log
from bench.measure.step_repeat import NotSteady

FULL_TRACE_ENV = job_environment.FULL_TRACE_VARIABLE  # "1": every prediction traces all its layers (no layer replay)
SMALLEST_TRACE_LAYERS = 3  # the layers of the smallest trace: at 2 the first layer's backward has no period before it
ALIKE_TRACED = (SMALLEST_TRACE_LAYERS, SMALLEST_TRACE_LAYERS + 1, SMALLEST_TRACE_LAYERS + 2)  # layers alike: proof last
SMALLEST_PLAIN_LAYERS = 2  # of a plan that leaves layers plain after checkpointed ones (`kinds_traced`)
# a plan of two kinds of layers replays where its traces hold at most this share of the full trace's layers: each of
# its four traces costs besides its layers about as much as a layer more (the model, embedding, loss and optimizer of
# three steps), and its template as much as about four more. Llama-3.1-8B at 4096 tokens, 25+7 layers, 26 traced, one
# process, quiet, seconds of the prediction by replay / by the full trace (the same bytes): lora+checkpoint 3.07-3.10
# / 3.30-3.40, bf16_weights+qlora+checkpoint 8.70-8.81 / 9.03-9.22 (2026-11-29, after the template's collector pause)
KINDS_MOST_TRACED_SHARE = 0.85


# --- a prediction's step by layer replay -------------------------------------------------------------------------

# configuration keys that make some layers unlike the others where they are set (dense layers before the MoE ones,
# MoE every other layer, sliding-window attention from some layer on)
_UNEVEN_LAYER_KEYS = ("first_k_dense_replace", "mlp_only_layers", "max_window_layers", "moe_layer_freq",
                      "decoder_sparse_step", "no_rope_layers", "cross_attention_layers")


def might_replay(workload_spec: str) -> bool:
    """Whether a prediction of the workload `workload_spec` may replay its layers, from the spec's text alone (reading
    the workload would ask torch about CUDA, which `proof_beside.stand_by` must come before): an `hf:` model whose
    `layers` option or preset has more than 5 layers, or says none (a Hub id, a folder)."""
    from workloads.framework.hf_presets import PRESETS

    head, *parts = str(workload_spec).strip().split(":")
    if head != "hf" or not parts:
        return False
    options = dict(part.split("=", 1) for part in parts[1:] if "=" in part)
    layers = options.get("layers") or PRESETS.get(parts[0], {}).get("num_hidden_layers")
    return layers is None or not str(layers).isdigit() or int(layers) >= SMALLEST_TRACE_LAYERS + 3


def layers_of(workload) -> int | None:
    """How many decoder layers an `hf:` workload's model has (its `layers` option, else its configuration's); None
    for a workload without that option."""
    settings = getattr(workload, "settings", None)
    if not isinstance(settings, dict) or "layers" not in settings or not hasattr(workload, "config"):
        return None
    return settings["layers"] or getattr(workload.config(), "num_hidden_layers", None)


def layers_of_case(case) -> int | None:
    """`layers_of` the case's workload."""
    from workloads import get_workload

    return layers_of(get_workload(case.workload))


def why_not_replayable(case, strategy, ranks: int, engine: str, snapshot: bool) -> str | None:
    """Why layer replay does not apply to this prediction (None where it does): a CUDA case on the fake engines, one
    rank (or a sharded strategy's ranks on fake CUDA: bench.analysis.layer_replay_ranks), no snapshot, an `hf:`
    decoder whose layers are all alike by its configuration, and a strategy that treats every layer alike or a
    checkpoint plan of checkpointed then plain layers whose traces hold few of its layers."""
    from workloads import get_workload

    if job_environment.full_trace_forced():
        return f"{FULL_TRACE_ENV} is set"
    if case.device != "cuda" or engine not in ("fake-cuda", "fake") or snapshot or case.phase != "train":
        return "not a CUDA training step on fake tensors"
    if ranks != 1 and not (strategy.distributed and engine == "fake-cuda"):
        return "ranks other than a sharded strategy's on fake CUDA"
    workload = get_workload(case.workload)
    layers = layers_of(workload)
    if layers is None or layers < SMALLEST_TRACE_LAYERS + 3:
        return "not a decoder stack of more than 5 layers"
    config = workload.config()
    for key in _UNEVEN_LAYER_KEYS:
        value = getattr(config, key, None)
        if value not in (None, 0, 1, [], (), False) and not (key == "max_window_layers" and value >= layers):
            return f"layers unlike one another ({key}={value})"
    for key, value in vars(config).items():
        if isinstance(value, (list, tuple)) and len(value) == layers and len(set(map(repr, value))) > 1:
            return f"layers unlike one another ({key})"
    for member in getattr(strategy, "members", [strategy]):  # a composite's members, else the strategy itself
        if member.name == "checkpoint" and member.settings.get("budget"):
            return "a checkpoint plan chosen by a budget"
        if member.distributed and ranks == 1:
            return "a sharded strategy on one rank"
    kinds = layer_kinds(strategy, layers)
    whole = [member for member in getattr(strategy, "members", [strategy]) if member.layer_kinds_traced_whole]
    if kinds is not None and whole:
        return f"a checkpoint plan of two kinds of layers with {whole[0].name} ({whole[0].layer_kinds_traced_whole})"
    traced = kinds and sum(c + p for c, p in kinds_traced(*kinds))
    if kinds is not None and traced > KINDS_MOST_TRACED_SHARE * layers:
        return (f"a checkpoint plan of {kinds[0]} checkpointed and {kinds[1]} plain layers: its replay would trace "
                f"{traced} layers, the full trace {layers}")
    return None


def layer_kinds(strategy, layers: int) -> tuple[int, int] | None:
    """(checkpointed layers, plain layers after them) of a checkpoint plan that checkpoints some of the `layers`
    and not the others (`segments` other than `all`: checkpoint_sequential's segments, each `hf:` layer its own
    checkpoint, the last segment plain); None where every layer is treated alike."""
    from strategies.checkpoint import recomputed_units, segment_plan

    for member in getattr(strategy, "members", [strategy]):
        if member.name == "checkpoint" and str(member.settings.get("segments")) != "all":
            segments = member.segments_for(layers)
            plan = segment_plan(layers, segments, chain=False) if segments <= layers else ()
            checkpointed = len(recomputed_units(plan))
            return (checkpointed, layers - checkpointed) if 0 < checkpointed < layers else None
    return None


def kinds_traced(checkpointed: int, plain: int) -> list[tuple[int, int]]:
    """The (checkpointed, plain) layers of the traces that replay a plan of both kinds, the proof's last: a few
    plain layers are kept as they are (the checkpointed ones vary); more are varied too, from SMALLEST_PLAIN_LAYERS
    (at 1 the plain layer's periods have no plain period before them to align with): the template over both counts
    from the smallest trace and one layer more of each kind, proven one layer past them in each."""
    first = SMALLEST_TRACE_LAYERS
    if plain <= SMALLEST_PLAIN_LAYERS:
        return [(first, plain), (first + 1, plain), (first + 2, plain)]
    least = SMALLEST_PLAIN_LAYERS
    return [(first, least), (first + 1, least), (first, least + 1), (first + 2, least + 2)]


def traced_layer_steps(kinds: tuple[int, int] | None, warmup_steps: int) -> int:
    """The layer-steps the small traces of a replay hold (`kinds`: as `replayed`'s): each trace's layers times the
    steps it runs, the proof every step, the others their warm-up steps (their measured step repeated)."""
    counts = kinds_traced(*kinds) if kinds is not None else [(count, 0) for count in ALIKE_TRACED]
    return sum((c + p) * (warmup_steps + (index == len(counts) - 1)) for index, (c, p) in enumerate(counts))


def with_layers(workload_spec: str, layers: int) -> str:
    """The workload's spec with `layers` decoder layers (its `layers` option set)."""
    if re.search(r":layers=\d+", workload_spec):
        return re.sub(r":layers=\d+", f":layers={layers}", workload_spec)
    return f"{workload_spec}:layers={layers}"


def _recompute_plan_at(plans: list[str], traced: list[int], layers: int) -> str | None:
    """The recompute plan at `layers` from those of the traces: the same at every count, or every layer alone
    (`0 1 2`); None otherwise."""
    if len(set(plans)) == 1:
        return plans[0]
    if all(plan == " ".join(map(str, range(count))) for plan, count in zip(plans, traced)):
        return " ".join(map(str, range(layers)))
    return None


def tracked_step_by_layers(case, spec: str, engine: str, warmup_steps: int | None,
                           capability: tuple[int, int] | None, prepare=None):
    """(the case's tracked step built by layer replay, or None, and why not): the step traced at
    SMALLEST_TRACE_LAYERS layers and one more, the log at the case's layers made from them, used only where the
    log it makes for two more layers equals a real trace of them event for event (see the module). The step
    carries the replayed log; its `tracker` is None (no snapshot) and `peak_bytes` is the log's live-bytes peak.
    `prepare`: as `tracer`'s (the plan counts each small trace's operators with it)."""
    from dataclasses import replace

    from bench.analysis.fake_engine import TrackedStep, bound_device
    from bench.run.case import bind_case
    from workloads import get_workload

    layers = layers_of(get_workload(case.workload))
    tried = (re.sub(r":seq_len=\d+", "", case.workload), spec, engine)
    if tried in _REFUSED:
        return None, f"{_REFUSED[tried]}, found on an earlier case of this model and strategy"
    kinds = layer_kinds(bind_case(replace(case, device=bound_device(engine)), 1)[0], layers)
    try:
        steps, events, plan, calls = replayed(tracer(case, spec, engine, warmup_steps, capability, prepare=prepare),
                                              layers, kinds)
        host = host_peak(steps, layers, kinds)
    except NoReplay as why:
        _REFUSED[tried] = str(why)
        return None, str(why)
    return TrackedStep(live_peak(events), events, engine, None, {}, steps[0].sdpa_kernel, calls, plan, host), None


def tracer(case, spec: str, engine: str, warmup_steps: int | None, capability: tuple[int, int] | None,
           ranks: int = 1, rank: int | None = None, prepare=None):
    """`trace(count, plain=None)`: the case's step at `count` layers, or with `plain`, at `count` checkpointed layers,
    each alone, and `plain` after them; with `rank`, as that rank of `ranks` in PyTorch's fake process group (the
    strategy bound and planned inside it). `prepare(strategy, count, plain, repeated)`, where given, returns the
    strategy the trace runs, made from the bound and planned one (`bench.analysis.plan` wraps an operator counter
    into it); `repeated`: whether the trace's measured step is its last warm-up step repeated (`repeat_warmup`, as
    `tracked_step`'s, where the engine allows it), not run."""
    import contextlib
    from dataclasses import replace

    from bench.analysis.fake_engine import PredictionMeter, bound_device, steady_warmup_possible, tracked_step
    from bench.run.case import bind_case
    from bench.run.ranks import fake_process_group

    device = bound_device(engine)

    def trace(count: int, plain: int | None = None, repeat_warmup: bool = False):
        small = replace(case, workload=with_layers(case.workload, count + (plain or 0)))
        group = (fake_process_group(ranks, rank, device="cuda" if device == "cuda" else None) if rank is not None
                 else contextlib.nullcontext())
        with group:
            planned = bind_case(replace(small, device=device), ranks if rank is not None else 1)[0]
            if plain is not None:
                for member in getattr(planned, "members", [planned]):
                    if member.name == "checkpoint":
                        member.plan_used = tuple((layer,) for layer in range(count))
            planned.plan(PredictionMeter(small))
            repeated = repeat_warmup and steady_warmup_possible(engine, warmup_steps)
            if prepare is not None:
                planned = prepare(planned, count, plain, repeated)
            return tracked_step(small, spec, engine, 1, cuda_autocast=True, ranks=ranks, record_events=True,
                                warmup_steps=warmup_steps, planned=planned, capability=capability,
                                repeat_warmup=repeated)
    trace.model_and_strategy = (re.sub(r":seq_len=\d+", "", case.workload), spec, engine, ranks, rank)
    # what a worker process needs to make the same trace (bench.analysis.proof_beside); none with `prepare`, whose
    # counters are this process's
    trace.made_by = tracer
    trace.arguments = None if prepare is not None else (case, spec, engine, warmup_steps, capability, ranks, rank)
    return trace


class ProofFailed(NoReplay):
    """The log a template made for the proof's layer count is not that trace's."""


# the models and strategies (`tracer`'s `model_and_strategy`) whose smaller traces' repeated steps failed a proof
# that their steps run proved: a step that is not steady (torchao's low-bit AdamW compiles its update anew in the
# second step); their smaller traces run every step from then on
UNSTEADY: set[tuple] = set()


def replayed(trace, layers: int, kinds: tuple[int, int] | None) -> tuple[list, list[MemoryEvent], str, int]:
    """(the small steps, the log at `layers`, its recompute plan, its calls of the CPU's attention kernel) by layer
    replay, `trace` tracing the step at a few layers (`tracer`); `kinds`: the plan's checkpointed and plain layers,
    where they differ (`layer_kinds`). NoReplay where the log made for the last traced count is not its trace's.
    The smaller traces repeat their last warm-up step for the measured one (`tracked_step`'s `repeat_warmup`); where
    the proof fails with them (or a step cannot be repeated: `NotSteady`), they run again with every step, and the
    model and strategy are marked `UNSTEADY`."""
    key = getattr(trace, "model_and_strategy", None)
    repeat = key not in UNSTEADY
    try:
        return _replayed_by_kind(trace, layers, kinds, repeat)
    except (ProofFailed, NotSteady):
        if not repeat:
            raise
        if key is not None:
            UNSTEADY.add(key)
        return _replayed_by_kind(trace, layers, kinds, False)


def _replayed_by_kind(trace, layers: int, kinds: tuple[int, int] | None, repeat: bool):
    if kinds is not None:
        return replayed_kinds(trace, *kinds, repeat=repeat)
    traced = list(ALIKE_TRACED)
    steps, events, plan = _replayed(trace, traced, layers, repeat)
    calls = [step.cpu_sdpa_calls for step in steps]
    return steps, events, plan, calls[0] + (calls[1] - calls[0]) * (layers - traced[0])


def _replayed(trace, traced: list[int], layers: int, repeat: bool = True) -> tuple[list, list[MemoryEvent], str]:
    """(the small steps, the log at `layers`, its recompute plan), `trace(count)` tracing the step at `count`
    layers; NoReplay where the log made for `traced[2]` layers is not their trace's. The template is made first:
    where the two smaller logs make none, the third trace is not run. `repeat`: the two smaller traces repeat their
    last warm-up step for the measured one."""
    proof = proof_beside.submit(trace, traced[2], None)
    steps = [trace(traced[0], repeat_warmup=repeat), trace(traced[1], repeat_warmup=repeat)]
    _check_alike(steps)
    template = LayerTemplate(measured_log(steps[0].events), measured_log(steps[1].events), traced[0])
    made = proof_beside.made_while_waiting
    expected, built = made(proof, template.events, traced[2]), made(proof, template.events, layers)
    steps.append(proof_beside.result(proof, trace, traced[2], None))
    _check_alike(steps)
    calls = [step.cpu_sdpa_calls for step in steps]
    if calls[2] - calls[1] != calls[1] - calls[0]:
        raise NoReplay("attention calls not the same per layer")
    plan = _recompute_plan_at([step.recompute_plan for step in steps], traced, layers)
    if plan is None:
        raise NoReplay("a recompute plan that differs by layer count")
    if expected() != measured_log(steps[2].events):
        raise ProofFailed(f"the log made for {traced[2]} layers differs from their trace")
    return steps, built(), plan


def replayed_kinds(trace, checkpointed: int, plain: int, repeat: bool = True) -> tuple[list, list[MemoryEvent], str,
                                                                                      int]:
    """(the small steps, the log of `checkpointed` layers then `plain` ones, its recompute plan, its calls of the CPU's
    attention kernel), `trace(c, p)` tracing the step at c checkpointed and p plain layers (`kinds_traced`); NoReplay
    where the log made for the last traced counts is not their trace's. Few plain layers are kept and the
    checkpointed ones vary, as `_replayed` varies every layer; otherwise one template over both counts
    (`LayerTemplate.of_kinds`: a run of periods grows with the layers of the kinds it repeats for; a storage named
    across the kinds, by the optimizer of every layer, is named by its layer). `repeat`: as `_replayed`'s."""
    counts = kinds_traced(checkpointed, plain)
    # a worker beside this process, where one stands by, takes the last of three smaller traces, then the proof
    here, beside = (counts[:-2], counts[-2:-1]) if len(counts) == 4 else (counts[:-1], [])
    sent = [proof_beside.submit(trace, *count, repeat_warmup=repeat) for count in beside]
    proof = proof_beside.submit(trace, *counts[-1])
    steps = [trace(*count, repeat_warmup=repeat) for count in here]
    steps += [proof_beside.result(future, trace, *count, repeat_warmup=repeat) for future, count in zip(sent, beside)]
    _check_alike(steps)
    logs = [measured_log(step.events) for step in steps]
    if len(counts) == 3:
        template = LayerTemplate(logs[0], logs[1], SMALLEST_TRACE_LAYERS)

        def build(checkpointed_layers: int, plain_layers: int) -> list[MemoryEvent]:
            return template.events(checkpointed_layers)
    else:
        template = LayerTemplate.of_kinds(logs[0], logs[1:], counts[0])

        def build(checkpointed_layers: int, plain_layers: int) -> list[MemoryEvent]:
            return template.events((checkpointed_layers, plain_layers))
    made = proof_beside.made_while_waiting
    expected, built = made(proof, build, *counts[-1]), made(proof, build, checkpointed, plain)
    steps.append(proof_beside.result(proof, trace, *counts[-1]))
    _check_alike(steps)
    if any(step.recompute_plan != " ".join(map(str, range(c))) for (c, _), step in zip(counts, steps)):
        raise NoReplay("a recompute plan other than each checkpointed layer alone")
    calls = solve([(c, p, step.cpu_sdpa_calls) for (c, p), step in zip(counts, steps)])
    if calls is None:
        raise NoReplay("attention calls not the same per layer of each kind")
    if expected() != measured_log(steps[-1].events):
        raise ProofFailed(f"the log made for {counts[-1][0]}+{counts[-1][1]} layers differs from their trace")
    try:
        calls_at_layers = evaluate(calls, checkpointed, plain)
    except NotWhole:
        raise NoReplay("attention calls not the same per layer of each kind") from None
    return steps, built(), " ".join(map(str, range(checkpointed))), calls_at_layers


# why layer replay was refused, by (workload spec without its length, strategy spec, engine): a search over lengths
# (fit) does not trace the small layer counts again for a model and strategy whose layers were found unlike
_REFUSED: dict[tuple, str] = {}


def host_peak(steps: list, layers: int, kinds: tuple[int, int] | None) -> int | None:
    """An offloading strategy's host peak (`offload_host_peak_bytes`) at `layers` from the small steps `replayed`
    traced (`kinds`: as `replayed`'s); None where no trace kept host copies. It is the exact affine function of the
    layer counts (of each kind) through every trace, the proof's included, which is one more than such a function
    needs: NoReplay where none goes through them all."""
    figures = [step.offload_host_peak_bytes for step in steps]
    if all(figure is None for figure in figures):
        return None
    if any(figure is None for figure in figures):
        raise NoReplay("host copies in some traces only")
    # (period, layers) as exact_affine takes them: a plan's checkpointed and plain layers, else the layer count alone
    counts = kinds_traced(*kinds) if kinds is not None else [(0, count) for count in ALIKE_TRACED]
    coefficients = solve([(first, second, figure) for (first, second), figure in zip(counts, figures)])
    try:
        if coefficients is None:
            raise NotWhole
        return evaluate(coefficients, *(kinds if kinds is not None else (0, layers)))
    except NotWhole:
        raise NoReplay("host copies that do not grow by the same bytes per layer") from None


def _check_alike(steps: list) -> None:
    """NoReplay where the small traces cannot stand for the full one, beyond their logs."""
    if len({step.sdpa_kernel for step in steps}) > 1:
        raise NoReplay("attention kernels that differ by layer count")


def replay_note(layers: int, kinds: tuple[int, int] | None = None) -> str:
    """What a row predicted by layer replay says (`kinds`: its checkpointed and plain layers, where they differ)."""
    if kinds is not None:
        traced = ", ".join(f"{checkpointed}+{plain}" for checkpointed, plain in kinds_traced(*kinds))
        return (f"layer replay: traced at {traced} checkpointed+plain layers, the {kinds[0]}+{kinds[1]}-layer log "
                f"built from all but the last (equal to its trace; {FULL_TRACE_ENV}=1 traces every layer)")
    return (f"layer replay: traced at {SMALLEST_TRACE_LAYERS}, {SMALLEST_TRACE_LAYERS + 1} and "
            f"{SMALLEST_TRACE_LAYERS + 2} layers, the {layers}-layer log built from the first two "
            f"(equal to the trace of {SMALLEST_TRACE_LAYERS + 2}; {FULL_TRACE_ENV}=1 traces every layer)")
