"""Explain: one case's peak memory module by module, and a checkpointing plan unit by unit.

The breakdown of a peak is `bench.measure.breakdown`, the article's estimate `bench.run.rule_of_thumb`; both run
below the runner, which writes them into every row. The largest batch under a budget is `bench.analysis.fit`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from bench.core.errors import UsageError
from bench.core.units import format_mib, format_size, parse_positive_size
from bench.measure.breakdown import BREAKDOWN_COLUMNS
from bench.run.rule_of_thumb import RULE_OF_THUMB_CAVEATS
from bench.run.runner import Case, CaseMeter, bind_case, memory_pass


def parse_bytes(text: str | int | float) -> int:
    """A positive size (`4GiB`, `512MiB`, `1.5GB`, `1e9`, `300000`) in bytes; a UsageError otherwise."""
    try:
        return parse_positive_size(text)
    except ValueError as error:
        raise UsageError(f"bad size {text!r}: {error}") from None


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


def explain(case, strategy, record_snapshot: bool = False) -> dict[str, Any]:
    """One tracked pass of the case with module hooks: the row's memory columns and the per-module table (and with
    `record_snapshot` the tracker's log of the step, for `bench.measure.snapshot.tracker_snapshot`)."""
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

    memory = memory_pass(case, strategy, prepare=prepare, record_snapshot=record_snapshot)
    tracker = memory.tracker
    by_index = {p.index: p.live_bytes for p in tracker.timeline}
    # the hooks go on after the warm-up and stay on for the steps after the measured one (its growth check): only
    # what starts before the measured step's last operator (the end of its timeline) is its forward
    last_op = tracker.timeline[-1].index if tracker.timeline else -1
    rows = [row for row in rows if row.start_op <= last_op]
    for row in rows:
        lives = [by_index[i] for i in range(row.start_op, row.end_op) if i in by_index]
        row.peak_within = max([row.before, row.after, *lives]) - row.before
    return {"memory": memory, "modules": rows, "tracker": tracker}


def format_explain(case, memory: dict, modules: list[ModuleRow], rule: dict) -> str:
    peak = memory["peak_mem_bytes"]
    lines = [f"{case.label()}  workload={case.workload} data={case.data}",
             f"peak (exact live tensor bytes): {peak:,} B = {format_mib(peak)} MiB, "
             f"in stage {memory['peak_stage']}", "",
             "breakdown of the peak:"]
    for column in BREAKDOWN_COLUMNS:
        value = memory[column]
        label = column.removeprefix("peak_").removesuffix("_bytes")
        label = "batch+buffers" if label == "batch" else label
        lines.append(f"  {label:<14} {format_mib(value):>10} MiB  {100 * value / peak:5.1f}%")
    lines.append(f"  {'total':<14} {format_mib(sum(memory[c] for c in BREAKDOWN_COLUMNS)):>10} MiB")
    lines += ["", "rule of thumb (the article: params + sum of module outputs"
              + (" x2 + optimizer state):" if case.phase == "train" else "):"),
              f"  params {format_mib(rule['params_bytes'])} MiB + outputs of {rule['modules_counted']} modules "
              f"{format_mib(rule['outputs_bytes'])} MiB x{rule['outputs_factor']} "
              f"+ optimizer {format_mib(rule['optimizer_bytes'])} MiB"
              f" = {format_mib(rule['total_bytes'])} MiB",
              f"  measured peak {format_mib(peak)} MiB; rule / measured = {rule['total_bytes'] / peak:.2f}",
              "  why it is off:"]
    lines += [f"  - {c}" for c in RULE_OF_THUMB_CAVEATS]
    lines += ["", "per module (forward of the measured step; added = live bytes after - before its forward,",
              "peak within = highest live bytes during it - before; MiB):",
              f"  {'module':<34} {'type':<18} {'output':>9} {'added':>9} {'peak within':>11}"]
    for row in modules:
        name = "  " * row.depth + row.name
        lines.append(f"  {name:<34} {row.kind:<18} {format_mib(row.output_bytes):>9} "
                     f"{format_mib(row.after - row.before):>9} {format_mib(row.peak_within):>11}")
    return "\n".join(lines)


# --- explain: a checkpointing plan unit by unit -------------------------------------------------------------

@dataclass
class UnitRow:
    index: int
    name: str
    checkpoint: str  # "0-2" for the checkpoint it belongs to, "" when it runs plainly
    forward_flops: int
    kept_bytes: int  # live bytes its forward adds in the baseline: what it keeps for backward (and its output)


def checkpoint_plan_of(strategy) -> tuple[str, list[tuple[int, ...]], str] | None:
    """(label, plan, kind) of the checkpointing member of `strategy` once its model was prepared, as the member
    declares it (`Strategy.recomputed_groups()`, `recompute_plan_kind`): a plan of whole units (kind `units`,
    labelled with its name, `checkpoint`) with the units each checkpoint recomputes, or one that recomputes within
    every unit (kind `operators`, labelled with its name and settings, `selective_checkpoint:policy=compute`) with
    no groups; None for the others."""
    for member in getattr(strategy, "members", [strategy]):
        groups = member.recomputed_groups()
        if groups is None:
            continue
        if member.recompute_plan_kind == "operators":
            return ":".join([member.name, *(f"{k}={v}" for k, v in member.settings.items())]), [], "operators"
        return member.name, groups, member.recompute_plan_kind
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


def format_plan_units(label: str, plan: list[tuple[int, ...]], kind: str, units: list[UnitRow], peak: int,
                      baseline_peak: int) -> str:
    """The plan unit by unit: which units are recomputed in backward and what each one's forward keeps in the
    baseline, which is what recomputing it can save."""
    for group in plan:
        span = f"{group[0]}-{group[-1]}" if len(group) > 1 else f"{group[0]}"
        for index in group:
            units[index].checkpoint = span
    selective = kind == "operators"  # recomputed within every unit, not whole units
    total_flops = sum(u.forward_flops for u in units) or 1
    recomputed = [u for u in units if u.checkpoint or selective]
    lines = ["", f"checkpointing plan ({label}): peak {format_mib(peak)} MiB "
                 f"against the baseline's {format_mib(baseline_peak)} MiB",
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


def default_case(strategy: str, phase: str, batch_size: int, device: str, data: str,
                 workload: str = "captcha_resnet18"):
    return Case(workload, strategy, phase, batch_size, device, data=data)
