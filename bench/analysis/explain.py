"""Memory analysis above the runner: `explain` (the peak module by module) and `fit` (the largest batch under a budget).

The breakdown of a peak is `bench.measure.breakdown`, the article's estimate `bench.run.rule_of_thumb`; both run below the
runner, which writes them into every row.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from bench.analysis import predict
from bench.core.errors import Unsupported, UsageError
from bench.core.units import format_size, parse_positive_size
from bench.measure.breakdown import BREAKDOWN_COLUMNS
from bench.run.rule_of_thumb import RULE_OF_THUMB_CAVEATS
from bench.run.runner import Case, CaseMeter, bind_case, forget_traceback, is_oom, memory_pass, timing_pass

def parse_bytes(text: str | int | float) -> int:
    """A positive size (`4GiB`, `512MiB`, `1.5GB`, `1e9`, `300000`) in bytes; a UsageError otherwise."""
    try:
        return parse_positive_size(text)
    except ValueError as error:
        raise UsageError(f"bad size {text!r}: {error}") from None


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


# --- explain: per-module table -----------------------------------------------------------------------------

@dataclass
class ModuleRow:
    name: str
    kind: str
    depth: int
    before: int
    after: int = 0
    start_op: int = 0
    end_op: int = 0
    peak_within: int = 0
    output_bytes: int = 0


def _leafish(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules worth a line: every module that is not the root and not a plain container (Sequential/ModuleList)."""
    return [(name, m) for name, m in model.named_modules()
            if name and not isinstance(m, (nn.Sequential, nn.ModuleList, nn.ModuleDict))]


def explain(case, strategy) -> dict[str, Any]:
    """One tracked pass of the case with module hooks: the row's memory columns and the per-module table."""
    rows: list[ModuleRow] = []
    open_rows: dict[int, list[ModuleRow]] = {}

    def prepare(session, tracker):
        tracker.record_timeline = True
        for name, module in _leafish(session.base_model):
            depth = name.count(".")

            def pre(mod, args, name=name, depth=depth):
                if tracker.stage != "forward":
                    return  # recomputation in backward (checkpointing) is not the module's forward
                row = ModuleRow(name, type(mod).__name__, depth, tracker.live_bytes, start_op=tracker._ops)
                open_rows.setdefault(id(mod), []).append(row)
                rows.append(row)

            def post(mod, args, output):
                stack = open_rows.get(id(mod))
                if tracker.stage != "forward" or not stack:
                    return
                row = stack.pop()
                row.after, row.end_op = tracker.live_bytes, tracker._ops
                tensors = [t for t in torch.utils._pytree.tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
                row.output_bytes = sum(t.numel() * t.element_size() for t in tensors)

            module.register_forward_pre_hook(pre)
            module.register_forward_hook(post)

    memory = memory_pass(case, strategy, prepare=prepare)
    tracker = memory.tracker
    by_index = {p.index: p.live_bytes for p in tracker.timeline}
    for row in rows:
        lives = [by_index[i] for i in range(row.start_op, row.end_op) if i in by_index]
        row.peak_within = max([row.before, row.after, *lives]) - row.before
    return {"memory": memory, "modules": rows, "tracker": tracker}


def format_explain(case, memory: dict, modules: list[ModuleRow], rule: dict) -> str:
    peak = memory["peak_mem_bytes"]
    lines = [f"{case.label()}  workload={case.workload} data={case.data}",
             f"peak (exact live tensor bytes): {peak:,} B = {mib(peak)} MiB, in stage {memory['peak_stage']}", "",
             "breakdown of the peak:"]
    for column in BREAKDOWN_COLUMNS:
        value = memory[column]
        label = column.removeprefix("peak_").removesuffix("_bytes")
        label = "batch+buffers" if label == "batch" else label
        lines.append(f"  {label:<14} {mib(value):>10} MiB  {100 * value / peak:5.1f}%")
    lines.append(f"  {'total':<14} {mib(sum(memory[c] for c in BREAKDOWN_COLUMNS)):>10} MiB")
    lines += ["", "rule of thumb (the article: params + sum of module outputs"
              + (" x2 + optimizer state):" if case.phase == "train" else "):"),
              f"  params {mib(rule['params_bytes'])} MiB + outputs of {rule['modules_counted']} modules "
              f"{mib(rule['outputs_bytes'])} MiB x{rule['outputs_factor']} + optimizer {mib(rule['optimizer_bytes'])} MiB"
              f" = {mib(rule['total_bytes'])} MiB",
              f"  measured peak {mib(peak)} MiB; rule / measured = {rule['total_bytes'] / peak:.2f}",
              "  why it is off:"]
    lines += [f"  - {c}" for c in RULE_OF_THUMB_CAVEATS]
    lines += ["", "per module (forward of the measured step; added = live bytes after - before its forward,",
              "peak within = highest live bytes during it - before; MiB):",
              f"  {'module':<34} {'type':<18} {'output':>9} {'added':>9} {'peak within':>11}"]
    for row in modules:
        name = "  " * row.depth + row.name
        lines.append(f"  {name:<34} {row.kind:<18} {mib(row.output_bytes):>9} {mib(row.after - row.before):>9} "
                     f"{mib(row.peak_within):>11}")
    return "\n".join(lines)


# --- explain: a checkpointing plan unit by unit ----------------------------------------------------------------

@dataclass
class UnitRow:
    index: int
    name: str
    checkpoint: str  # "0-2" for the checkpoint it belongs to, "" when it runs plainly
    forward_flops: int
    kept_bytes: int  # live bytes its forward adds in the baseline: what it keeps for backward (and its output)


def checkpoint_plan_of(strategy) -> tuple[str, list[tuple[int, ...]]] | None:
    """(kind, plan) of the checkpointing member of `strategy` once its model was prepared, as the member declares
    it (`Strategy.recomputed_groups()`): a plan of whole units (kind: its name, `checkpoint`) with the units each
    checkpoint recomputes, or one that recomputes within every unit (kind: its name and settings,
    `selective_checkpoint:policy=compute`) with no groups; None for the others."""
    for member in getattr(strategy, "members", [strategy]):
        groups = member.recomputed_groups()
        if groups is None:
            continue
        if member.recompute_plan_kind == "operators":
            return ":".join([member.name, *(f"{k}={v}" for k, v in member.settings.items())]), []
        return member.name, groups
    return None


def plan_units(case) -> list[UnitRow]:
    """Each checkpoint unit of the case's workload: its forward FLOPs and what its forward keeps alive in the
    baseline's measured step (live bytes after its forward minus before)."""
    baseline = replace(case, strategy="baseline")
    strategy = bind_case(baseline)[0]
    kept: dict[int, int] = {}
    names: list[str] = []

    def prepare(session, tracker):
        units = session.workload.checkpoint_units(session.base_model)
        module_names = {id(m): name for name, m in session.base_model.named_modules()}
        names.extend(module_names.get(id(unit)) or f"{type(unit).__name__}" for unit in units)
        for index, unit in enumerate(units):
            def before(module, args, index=index):
                kept[index] = -tracker.live_bytes

            def after(module, args, output, index=index):
                kept[index] += tracker.live_bytes
            unit.register_forward_pre_hook(before)
            unit.register_forward_hook(after)

    memory_pass(baseline, strategy, prepare=prepare)
    flops = CaseMeter(baseline).unit_flops()
    return [UnitRow(i, names[i], "", flops[i], kept.get(i, 0)) for i in range(len(names))]


def format_plan_units(kind: str, plan: list[tuple[int, ...]], units: list[UnitRow], peak: int,
                      baseline_peak: int) -> str:
    """The plan unit by unit: which units are recomputed in backward and what each one's forward keeps in the
    baseline, which is what recomputing it can save."""
    for group in plan:
        label = f"{group[0]}-{group[-1]}" if len(group) > 1 else f"{group[0]}"
        for index in group:
            units[index].checkpoint = label
    selective = kind.startswith("selective")
    total_flops = sum(u.forward_flops for u in units) or 1
    recomputed = [u for u in units if u.checkpoint or selective]
    lines = ["", f"checkpointing plan ({kind}): peak {mib(peak)} MiB against the baseline's {mib(baseline_peak)} MiB",
             ("  every unit is its own checkpoint; in backward only its cheap ops are recomputed (the policy keeps the "
              "outputs of its expensive ones)") if selective else
             (f"  {len(recomputed)} of {len(units)} units recomputed in backward, "
              f"{sum(u.forward_flops for u in recomputed) / 1e9:,.3f} of {total_flops / 1e9:,.3f} forward GFLOP; a "
              "checkpoint keeps only its first unit's input, so it saves what its units keep, less that input"),
             f"  {'unit':<4} {'module':<26} {'checkpoint':>10} {'fwd GFLOP':>10} {'kept':>11} {'saves':>11}"]
    for u in units:
        saves = format_size(u.kept_bytes) if u.checkpoint else ("part" if selective else "-")
        lines.append(f"  {u.index:<4} {u.name[:26]:<26} {u.checkpoint or ('each' if selective else '-'):>10} "
                     f"{u.forward_flops / 1e9:>10,.3f} {format_size(u.kept_bytes):>11} {saves:>11}")
    lines.append("  (kept: live bytes the unit's forward adds in the baseline's measured step, its output included)")
    return "\n".join(lines)


# --- fit: the largest batch under a budget -------------------------------------------------------------------

@dataclass
class FitResult:
    strategy: str
    phase: str
    device: str
    budget_bytes: int
    batch_size: int  # 0: not even batch 1 fits
    peak_bytes: int | None
    verified: bool
    next_batch_peak_bytes: int | None  # the peak at batch_size + 1 (probe or measured), over budget
    next_batch_method: str
    time_per_sample_ms: float | None
    note: str
    runs: int  # actual tracked (or CUDA) runs made


def measured_peak(case, strategy) -> int:
    """An actual run: the exact tracked peak on the CPU, max_memory_allocated on CUDA (its warm-up steps and the
    measured one, no step after it)."""
    return int(memory_pass(case, strategy, growth_steps=0)["peak_mem_bytes"])


def _probe_peak(case, spec: str) -> int | None:
    """A cheap estimate of the CPU peak: the same tracked step on fake tensors (no arithmetic), or None."""
    try:
        return predict.tracked_peak(case, spec, engine="fake", block_bytes=1, cuda_autocast=False)
    except Exception as error:  # noqa: BLE001 - a strategy that fake tensors cannot run: the per-stage model
        forget_traceback(error)
        return None


def stage_peaks(case, strategy) -> tuple[dict[str, int], int]:
    """One tracked step: the peak of live bytes within each stage (forward, backward, optimizer), and the peak."""
    memory = memory_pass(case, strategy, record_timeline=True)
    tracker = memory.tracker
    peaks: dict[str, int] = {}
    for point in tracker.timeline:
        peaks[point.stage] = max(peaks.get(point.stage, 0), point.live_bytes)
    return peaks, int(memory["peak_mem_bytes"])


def _quiet(text: str) -> None:
    pass


def largest_under(peak_at: Callable[[int], int], budget: int, low: int, high: int, max_batch: int) -> int:
    """The largest batch b <= max_batch with peak_at(b) <= budget (0 if none), for a peak that grows with the batch.

    Secant steps from `low` and `high` (the peak is linear in the batch within a regime, so they land on the answer
    or next to it in two or three probes), then bisection between the largest batch seen to fit and the smallest
    seen not to, probing upward by doubling when none was seen over the budget."""
    fits = lambda b: b == 0 or peak_at(b) <= budget  # noqa: E731
    a, b = low, high
    for _ in range(6):
        slope = max((peak_at(b) - peak_at(a)) / (b - a), 1.0)
        guess = int(min(max_batch, max(0, b + math.floor((budget - peak_at(b)) / slope))))
        if guess in (a, b):
            break
        a, b = b, guess
    seen = [0, a, b, b + 1 if b < max_batch else b]
    fit_seen = [x for x in seen if fits(x)]
    lo = max(fit_seen)
    over = [x for x in seen if not fits(x)]
    hi = min(over) if over else None
    while hi is None:
        candidate = min(max_batch, max(1, 2 * lo))
        if candidate == lo:
            return lo
        if fits(candidate):
            lo = candidate
        else:
            hi = candidate
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def peak_or_none_on_oom(case) -> int | None:
    """The measured peak of `case`, or None when it runs out of memory (any other error propagates)."""
    try:
        return measured_peak(case, bind_case(case)[0])
    except Exception as error:  # noqa: BLE001 - only an out-of-memory error is an answer here
        if not is_oom(error):
            raise
        forget_traceback(error)
        return None


def fit_cpu(spec: str, budget: int, phase: str, workload: str, data: str, max_batch: int,
            low: int = 16, high: int = 32, progress: Callable[[str], None] = _quiet) -> FitResult:
    """Largest batch with peak <= budget on the CPU, confirmed by actual tracked runs.

    With fake tensors (`bench.analysis.fake_engine`: the exact tracker without arithmetic, a second or so per probe at any
    batch): `largest_under` on fake probes. Where fake tensors cannot run the strategy: the peak within each stage
    of the step (forward, backward, optimizer) is linear in the batch size, so two tracked runs give one line per
    stage and the step's peak is the largest of them at any batch -- which a single slope from small batches is not
    (there the peak is Adam's step; at large ones it is the backward). Then one actual tracked run at the answer (a
    warm-up step and the measured one), stepping down while over the budget: fake tensors differ from the CPU by
    its loss kernels' buffers, a few hundred bytes per sample, which a step down corrects with the offset measured.
    """
    def case_at(b: int, device: str = "cpu"):
        return Case(workload, spec, phase, b, device, data=data, warmup=0, steps=1)

    runs = 0
    actual: dict[int, int | float] = {}

    def real(b: int) -> int | float:
        """The measured peak at batch `b`; infinite when the CPU allocator runs out of memory (over any budget)."""
        nonlocal runs
        if b not in actual:
            case = case_at(b)
            progress(f"fit {spec}: tracked run at batch {b} ...")
            actual[b] = peak_or_none_on_oom(case)
            if actual[b] is None:
                actual[b] = math.inf
            runs += 1
            progress(f"fit {spec}: batch {b}: " + ("out of memory" if actual[b] == math.inf else
                                                   f"peak {mib(actual[b])} MiB, budget {mib(budget)} MiB"))
        return actual[b]

    first_probe = _probe_peak(case_at(low), spec)
    if first_probe is not None:
        probes: dict[int, int] = {low: first_probe}

        def estimate(b: int) -> int:
            if b not in probes:
                probes[b] = _probe_peak(case_at(b), spec)
                progress(f"fit {spec}: fake-tensor probe at batch {b}: {mib(probes[b])} MiB")
            return probes[b]

        batch, method = largest_under(estimate, budget, low, high, max_batch), "fake probe"
        slope = max((estimate(high) - estimate(low)) / (high - low), 1.0)
    else:
        lines = {}
        (peaks_low, actual[low]), (peaks_high, actual[high]) = (
            stage_peaks(case_at(b), bind_case(case_at(b))[0]) for b in (low, high))
        runs += 2
        for stage in peaks_low.keys() & peaks_high.keys():
            slope_s = (peaks_high[stage] - peaks_low[stage]) / (high - low)
            lines[stage] = (peaks_low[stage] - slope_s * low, slope_s)

        def estimate(b: int) -> int:
            return round(max(base_s + slope_s * b for base_s, slope_s in lines.values()))

        slope = max(max(slope_s for _, slope_s in lines.values()), 1.0)
        batch = max_batch
        for base_s, slope_s in lines.values():
            if slope_s > 0:
                batch = min(batch, math.floor((budget - base_s) / slope_s))
            elif base_s > budget:
                batch = 0
        batch, method = max(0, batch), "per-stage linear model"
    # confirm with actual runs; step down while over the budget
    note = ""
    while batch >= 1 and real(batch) > budget:
        over = real(batch) - budget
        if over != math.inf and method == "fake probe":
            offset = real(batch) - estimate(batch)  # what the CPU holds that fake tensors do not
            batch = min(batch - 1, largest_under(lambda b: estimate(b) + offset, budget, low, high, batch))
        else:
            batch -= max(1, batch // 2) if over == math.inf else max(1, math.ceil(over / slope))
    if batch < 1:
        return FitResult(spec, phase, "cpu", budget, 0, None, False, None, "", None,
                         "even batch 1 exceeds the budget", runs)
    if batch + 1 in actual:
        nxt, how = actual[batch + 1], "measured"
        if nxt == math.inf:
            nxt, how = None, "measured: out of memory"
    elif batch >= max_batch:
        nxt, how, note = None, "", f"capped by --max-batch {max_batch}"
    else:
        # the model's step from the measured peak: the model itself may be off by a few MiB at large batches
        nxt, how = real(batch) + estimate(batch + 1) - estimate(batch), f"{method} from the measured batch"
    return FitResult(spec, phase, "cpu", budget, batch, real(batch), True, nxt, how, None, note, runs)


def fit_cuda(spec: str, budget: int, phase: str, workload: str, data: str, max_batch: int,
             progress: Callable[[str], None] = _quiet) -> FitResult:
    """Largest batch on CUDA by real attempts: doubling until the peak passes the budget or an OOM, then bisection."""
    runs = 0
    results: dict[int, int | None] = {}

    def attempt(b: int) -> int | None:
        nonlocal runs
        if b in results:
            return results[b]
        case = Case(workload, spec, phase, b, "cuda", data=data)
        runs += 1
        progress(f"fit {spec}: run at batch {b} ...")
        results[b] = peak_or_none_on_oom(case)
        return results[b]

    def fits(b: int) -> bool:
        peak = attempt(b)
        return peak is not None and peak <= budget

    good, bad = 0, None
    b = 1
    while b <= max_batch:
        if fits(b):
            good, b = b, b * 2
        else:
            bad = b
            break
    if bad is None:
        bad = max_batch + 1
        if good < max_batch and fits(max_batch):
            good = max_batch
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    if good == 0:
        return FitResult(spec, phase, "cuda", budget, 0, None, False, None, "", None, "even batch 1 does not fit", runs)
    nxt = results.get(good + 1)
    return FitResult(spec, phase, "cuda", budget, good, results[good], True, nxt,
                     "measured (None = OOM)" if good + 1 in results else "", None,
                     "" if good < max_batch else f"capped by --max-batch {max_batch}", runs)


def time_per_sample(spec: str, phase: str, device: str, workload: str, data: str, batch: int,
                    steps: int) -> float:
    """Milliseconds per sample from a short timing run at `batch` (no memory tracking)."""
    case = Case(workload, spec, phase, batch, device, data=data, warmup=0 if device == "cpu" else 1, steps=steps)
    return timing_pass(case, bind_case(case)[0])["step_time_ms_median"] / batch


def fit(specs: list[str], budget: int, phase: str = "train", device: str = "cpu",
        workload: str = "captcha_resnet18", data: str = "synthetic", max_batch: int = 4096,
        time_steps: int = 1, progress: Callable[[str], None] = _quiet) -> list[FitResult]:
    """`fit` for each strategy (baseline first, always included); `time_steps=0` skips the timing run.

    `progress` is told each run as it starts and ends (the CLI prints it on stderr)."""
    specs = ["baseline"] + [s for s in specs if s != "baseline"]
    results = []
    for spec in specs:
        strategy, context = bind_case(Case(workload, spec, phase, 1, device, data=data))
        try:
            strategy.check(context)
        except Unsupported as error:
            results.append(FitResult(strategy.spec(), phase, device, budget, 0, None, False, None, "", None,
                                     f"unsupported: {error}", 0))
            continue
        finder = fit_cuda if device == "cuda" else fit_cpu
        progress(f"fit {strategy.spec()}: searching for the largest batch under {mib(budget)} MiB ...")
        try:
            result = finder(strategy.spec(), budget, phase, workload, data, max_batch, progress=progress)
        except Unsupported as error:  # e.g. checkpoint:budget, whose plan is chosen per case, not per batch search
            results.append(FitResult(strategy.spec(), phase, device, budget, 0, None, False, None, "", None,
                                     f"unsupported: {error}", 0))
            continue
        if result.batch_size >= 1:
            if time_steps > 0:
                progress(f"fit {strategy.spec()}: timing {time_steps} step(s) at batch {result.batch_size} ...")
                result.time_per_sample_ms = time_per_sample(result.strategy, phase, device, workload, data,
                                                            result.batch_size, time_steps)
            else:
                result.note = (result.note + "; " if result.note else "") + "time not measured (--time-steps 0)"
        results.append(result)
    return results


def fit_rows(results: list[FitResult]) -> list[dict]:
    return [asdict(r) for r in results]


def mib_beside_budget(n_bytes: int, budget_bytes: int) -> str:
    """MiB to one decimal, rounded away from the budget: a peak over the budget never prints as equal to it or
    below it, and a peak under it never prints above it."""
    tenths = n_bytes / 2**20 * 10
    tenths = math.ceil(tenths) if n_bytes > budget_bytes else math.floor(tenths)
    return f"{tenths / 10:,.1f}"


def format_fit(results: list[FitResult], time_steps: int) -> str:
    header = (f"{'strategy':<28} {'phase':<5} {'largest batch':>13} {'peak MiB':>9} {'budget MiB':>10} "
              f"{'next MiB':>9} {'ms/sample':>9} {'runs':>4}  note")
    lines = [header, "-" * len(header)]
    for r in results:
        peak = mib_beside_budget(r.peak_bytes, r.budget_bytes) if r.peak_bytes is not None else "-"
        nxt = (mib_beside_budget(r.next_batch_peak_bytes, r.budget_bytes) if r.next_batch_peak_bytes is not None
               else "-")
        t = f"{r.time_per_sample_ms:.2f}" if r.time_per_sample_ms is not None else "-"
        verified = "verified by a tracked run" if r.verified and r.device == "cpu" else \
            ("verified by a run" if r.verified else "")
        note = "; ".join(x for x in (verified, f"next batch by {r.next_batch_method}" if r.next_batch_method else "",
                                       r.note) if x)
        budget = mib_beside_budget(r.budget_bytes, r.budget_bytes)
        lines.append(f"{r.strategy:<28} {r.phase:<5} {r.batch_size:>13} {peak:>9} {budget:>10} "
                     f"{nxt:>9} {t:>9} {r.runs:>4}  {note}")
    lines.append(f"(ms/sample from {time_steps} timed step(s) at the largest batch, no warm-up on the CPU)"
                 if time_steps else "(time not measured)")
    return "\n".join(lines)


def default_case(strategy: str, phase: str, batch_size: int, device: str, data: str,
                 workload: str = "captcha_resnet18"):
    return Case(workload, strategy, phase, batch_size, device, data=data)
