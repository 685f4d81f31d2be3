"""Explain: one case's peak memory module by module, and a checkpointing plan unit by unit.

The breakdown of a peak is `bench.measure.breakdown`, the article's estimate `bench.run.rule_of_thumb`; both run
below the runner, which writes them into every row. The largest batch under a budget is `bench.analysis.fit`.
The console text of both is `bench.cli.analysis_console`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from bench.run.case import bind_case
from bench.run.runner import CaseMeter, memory_pass
from strategies.framework.composite import members_of


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
    for member in members_of(strategy):
        groups = member.recomputed_groups()
        if groups is None:
            continue
        if member.recompute_plan_kind == "operators":
            return ":".join([member.name, *(f"{k}={v}" for k, v in member.settings.items())]), [], "operators"
        return member.name, groups, member.recompute_plan_kind
    return None


def plan_units(case, plan: list[tuple[int, ...]] = ()) -> list[UnitRow]:
    """Each checkpoint unit of the case's workload: its forward FLOPs, what its forward keeps alive in the
    baseline's measured step (live bytes after its forward minus before), and the checkpoint of `plan` (groups of
    unit indices) it belongs to."""
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
    spans = {index: f"{group[0]}-{group[-1]}" if len(group) > 1 else f"{group[0]}" for group in plan for index in group}
    return [UnitRow(i, names[i], spans.get(i, ""), flops[i], kept.get(i, 0)) for i in range(len(names))]


