"""`plan` on several ranks searches the mesh as well as the count: the dp x tp meshes whose tp degree splits the
model evenly and stays inside a node (`--gpus-per-node`), as `fsdp+tp:degree=T` candidates; the answer names its
mesh. On tiny Llama-layout models on the CPU."""

from __future__ import annotations

import dataclasses
import json
import re

import pandas as pd
import torch
import pytest

from bench.analysis import plan, plan_candidates, plan_cost, plan_search
from bench.cli.commands_analysis import _batch_split
from bench.cli.main import main
from bench.measure.op_cost import CONV, MATMUL, CpuSpeed
from bench.run.case import Case
from strategies import PlanSpace, StrategySpec, parse_strategy
from strategies.framework.composite import members_of
from workloads.framework.hf_presets import PRESETS

TINY_LLAMA = "hf:tiny-llama:seq_len=16"  # 4 heads, 2 key/value heads: tp degree 2 only
FIGURES = plan_cost.to_json(plan_cost.cpu_figures(CpuSpeed({(kind, dtype): 1e10 for kind in (MATMUL, CONV)
                                                            for dtype in ("float32", "bfloat16")}, 1e10, 1e-6),
                                                   "test CPU"))


def _tp_degrees(workload: str, ranks: int, gpus_per_node: int) -> dict[int, str]:
    """The tp degrees of the plan's accepted settings on `ranks` ranks, each with its candidate's spec."""
    context = plan.bind_for_plan(Case(workload, "baseline", "train", 8, "cpu", data="text"), ranks)[1]
    accepted, _ = plan_candidates.settings(PlanSpace(context, 2**40, gpus_per_node))
    found = {}
    for setting in accepted:
        members = {m.name: m for m in members_of(StrategySpec(setting.spec).build())}
        if "tp" in members:
            found[members["tp"].settings["degree"]] = setting.spec
    return found


@pytest.fixture(scope="module")
def eight_heads(tmp_path_factory) -> str:
    """tiny-llama's architecture with 8 attention heads and 4 key/value heads: degrees 2 and 4 split it, 8 does not
    (it does not divide the key/value heads)."""
    values = {**PRESETS["tiny-llama"], "hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 4}
    path = tmp_path_factory.mktemp("eight_heads") / "config.json"
    path.write_text(json.dumps(values))
    return f"hf:{path}:seq_len=16"


def test_the_meshes_tried_split_the_heads_evenly_and_stay_inside_a_node(eight_heads):
    # 8 ranks, 8 GPUs a node: degree 8 divides the heads but not the key/value heads, so it is never tried
    assert set(_tp_degrees(eight_heads, 8, 8)) == {2, 4}
    assert set(_tp_degrees(eight_heads, 8, 2)) == {2}  # a node of 2: no group of 4 may straddle two
    assert set(_tp_degrees(eight_heads, 8, 6)) == {2}  # 4 does not divide a node of 6
    assert _tp_degrees(eight_heads, 8, 1) == {}
    assert set(_tp_degrees(TINY_LLAMA, 8, 8)) == {2}  # 4 divides its 4 heads, not its 2 key/value heads
    # with more than one data-parallel replica the mesh is fsdp over dp; on exactly T ranks, tp alone
    by_degree = _tp_degrees(eight_heads, 4, 8)
    assert {members.name for members in members_of(StrategySpec(by_degree[2]).build())} == {"tp", "fsdp"}
    assert {members.name for members in members_of(StrategySpec(by_degree[4]).build())} == {"tp"}
    assert _tp_degrees(eight_heads, 1, 8) == {}  # one rank: no mesh


def test_the_fewest_gpus_answer_names_the_mesh(tmp_path, capsys):
    """tp alone on 2 ranks does not fit (the budget is its own step, less the headroom), fsdp x tp on 4 does."""
    request = plan.PlanRequest(TINY_LLAMA, "text", 4, "cpu", "this CPU", 2**40, 0, FIGURES, strategies=["tp"],
                               max_candidates=4)
    on_two = {r["strategy"]: r for r in plan_search.search(dataclasses.replace(request, ranks=2)).rows}
    alone = on_two["tp"]["judged_bytes"]
    code = main(["plan", "--workload", TINY_LLAMA, "--global-batch-size", "4", "--budget", str(alone), "--device",
                 "cpu", "--max-ranks", "4", "--strategies", "tp", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"answer: 4 GPUs as 2 dp x 2 tp, with tp\+fsdp: ", out), out
    assert re.search(r"^ +2 dp x 2 tp +tp\+fsdp .* yes  <- answer$", out, re.M), out  # the answer's front
    (csv,) = tmp_path.glob("plan-*.csv")
    ran = pd.read_csv(csv)
    assert set(ran.loc[ran["ranks"] == 2, "strategy"]) == {"tp"}  # 1 dp x 2 tp, over the budget
    assert ran.loc[ran["ranks"] == 2, "judged_bytes"].item() == alone


def test_gpus_per_node_of_one_tries_no_mesh(tmp_path, capsys):
    code = main(["plan", "--workload", TINY_LLAMA, "--global-batch-size", "4", "--budget", "1GiB", "--device", "cpu",
                 "--ranks", "2", "--strategies", "tp,fsdp", "--gpus-per-node", "1", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    (csv,) = tmp_path.glob("plan-*.csv")
    assert not any("tp" in spec.split("+") for spec in pd.read_csv(csv)["strategy"])


@pytest.mark.parametrize("value", ["0", "-8", "eight"])
def test_a_bad_gpus_per_node_is_one_line_and_exit_2(value, capsys):
    code = main(["plan", "--workload", TINY_LLAMA, "--budget", "1MiB", "--device", "cpu", "--max-ranks", "4",
                 "--gpus-per-node", value])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--gpus-per-node" in err and value in err, err


def test_predicts_batch_line_splits_over_the_data_parallel_replicas():
    specs = ["fsdp", "tp:degree=2+fsdp", "tp:degree=4"]
    lines = _batch_split(specs, [parse_strategy(s) for s in specs], [8], 4).splitlines()
    assert lines == [
        "batch: the step's, over 4 ranks with fsdp (8: 2 a rank)",
        "batch: the step's, over the 2 data-parallel replicas of 4 ranks (each group of 2 shares its samples) with "
        "tp:degree=2+fsdp (8: 4 a rank)",
        "batch: the step's, over the 1 data-parallel replica of 4 ranks (each group of 4 shares its samples) with "
        "tp:degree=4 (8: 8 a rank)"]
    assert _batch_split(["fsdp"], [parse_strategy("fsdp")], [6], 4) == \
        "batch: the step's, over 4 ranks (6: 2 or 1 a rank)"


def test_a_ranks_operator_costs_are_those_of_its_shards():
    """A dispatch mode sees a DTensor's operator at the global shape; the rank computes on its shards only, so a
    column-parallel projection over 2 ranks costs each rank half the FLOPs of the whole one (tp's estimated time)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from bench.measure.op_cost import OperatorCostCounter, step_totals
    from bench.run.ranks import fake_process_group

    inputs, weight = torch.randn(3, 4), torch.randn(8, 4)
    whole = OperatorCostCounter()
    with whole:
        torch.nn.functional.linear(inputs, weight)
    whole.end_step()
    with fake_process_group(2, 0):
        mesh = DeviceMesh("cpu", [0, 1])
        sharded = OperatorCostCounter()
        with sharded:
            out = torch.nn.functional.linear(distribute_tensor(inputs, mesh, [Replicate()]),
                                             distribute_tensor(weight, mesh, [Shard(0)]))
        sharded.end_step()
    assert out.to_local().shape == (3, 4)
    assert step_totals(sharded.steps[0])["flops"] * 2 == step_totals(whole.steps[0])["flops"] > 0


def test_on_cuda_each_mesh_and_fsdp_are_also_tried_with_fsdps_mixed_precision_policy():
    """torchtitan's meshes run FSDP2 with parameters in bfloat16 and gradients reduced in float32 (tp refuses amp's
    autocast: this is how a mesh computes in 16 bits); on the CPU, where the planner tries no 16-bit policy, not."""
    mixed = "fsdp:param_dtype=bfloat16:reduce_dtype=float32"
    tried = {}
    for device in ("cuda", "cpu"):
        context = plan.bind_for_plan(Case("hf:llama-3.1-8b:seq_len=16", "baseline", "train", 8, device,
                                          data="synthetic"), 4)[1]
        accepted, _ = plan_candidates.settings(PlanSpace(context, 2**40, 8))
        tried[device] = {s.spec for s in accepted if s.strategy in ("fsdp", "tp")}
    assert tried["cuda"] == {"tp:degree=4", f"tp:degree=4+{mixed}", "tp+fsdp", f"tp+{mixed}", "fsdp",
                             "fsdp:offload=cpu", mixed, "fsdp:offload=cpu:param_dtype=bfloat16:reduce_dtype=float32"}
    assert tried["cpu"] == {"tp:degree=4", "tp+fsdp", "fsdp"}
