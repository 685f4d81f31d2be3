"""DeepSpeed ZeRO-2 and ZeRO-3 as membench models them (strategies/framework/deepspeed_zero.py): on 2 CPU ranks
(gloo) each matches one process on the global batch and predict's one-process estimate equals the real ranks to
the byte; against DeepSpeed itself (its engine on 2 gloo ranks, its CPU accelerator), the bytes each keeps by what
they are are DeepSpeed's, each remaining difference named."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.analysis.fake_engine import tracked_step
from bench.analysis.predict import predict_case
from bench.core.memory_categories import COMMUNICATION
from bench.run.case import Case
from bench.run.isolation import RunOptions
from bench.run.ranks import fake_process_group
from bench.run.runner import run_case
from strategies import STRATEGIES

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = "gpt_mini:layers=2:width=32:heads=2:seq_len=16:dropout=0.0"  # tied head: ZeRO-3 gathers it twice
RANKS = RunOptions(threads=1, ranks=2)
ZERO2, ZERO3 = STRATEGIES.get("zero2").test_spec, STRATEGIES.get("zero3").test_spec


def _case(strategy: str) -> Case:
    return Case(WORKLOAD, strategy, "train", 4, "cpu", data="synthetic", warmup=0, steps=1)


@functools.lru_cache(maxsize=None)
def _row(strategy: str) -> dict:
    return run_case(_case(strategy), env={}, options=RANKS)


@pytest.mark.parametrize("strategy", [ZERO2, ZERO3])
def test_the_step_matches_one_process_and_the_prediction_equals_the_real_ranks_to_the_byte(strategy):
    measured = _row(strategy)
    assert measured["status"] == "ok" and measured["matches_baseline"] is True, measured["message"]
    steps = []
    for rank in range(RANKS.ranks):
        with fake_process_group(RANKS.ranks, rank):
            steps.append(tracked_step(_case(strategy), strategy, "cpu", ranks=RANKS.ranks, cuda_autocast=False))
    assert sorted(step.peak_bytes for step in steps) == [measured["rank_peak_min_bytes"],
                                                         measured["rank_peak_max_bytes"]]
    largest = max(steps, key=lambda step: step.peak_bytes).peak_by_category
    for category, column in {"params": "peak_params_bytes", "grads": "peak_grads_bytes",
                             "optimizer_state": "peak_optimizer_bytes",
                             COMMUNICATION: "peak_communication_bytes"}.items():
        assert largest.get(category, 0) == measured[column], (category, largest, measured)
    assert largest[COMMUNICATION] > 0, "the gradient bucket is at the peak"
    predicted = predict_case(_case(strategy), engine="cpu", ranks=2)
    assert predicted["predicted_bytes"] == measured["rank_peak_max_bytes"], predicted


def test_both_keep_the_optimizer_state_of_half_the_model_and_zero3s_ranks_hold_the_same():
    zero2, zero3 = _row(ZERO2), _row(ZERO3)
    # a float32 master and Adam's two moments of half the parameters each (zero3 pads each parameter, zero2 the whole)
    assert abs(zero3["peak_optimizer_bytes"] - zero2["peak_optimizer_bytes"]) < 0.05 * zero2["peak_optimizer_bytes"]
    # every rank holds ceil(numel / 2) of every parameter: real ranks of equal batch shares peak alike
    assert zero3["rank_peak_min_bytes"] == zero3["rank_peak_max_bytes"]


def test_offload_is_refused_on_the_cpu_where_the_host_is_the_device():
    row = run_case(_case(f"{ZERO3}:offload_optimizer=cpu"), env={}, options=RANKS)
    assert row["status"] == "unsupported" and "offload to cpu needs device cuda" in row["message"]


# --- against DeepSpeed itself -----------------------------------------------------------------------------------

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
# The one difference left, in bytes DeepSpeed 0.19.8 keeps more, by (stage, offload, inventory entry, rank): without
# offload, ZeRO-2's backward epilogue lists the last rank's gradients with a zero tensor of the flat buffer's alignment
# padding (`get_all_grad_tensors` on the padded group: 1,850 elements padded to 1,852, 2 float32) alive until the step.
MODEL_ELEMENTS = 3 * (24 * 24 + 24) + 24 * 2 + 2  # tests/deepspeed_ranks.py's model
PADDING_BYTES = (-MODEL_ELEMENTS % (2 * 2)) * 4  # stage_1_and_2.py pads the flat buffer to 2 x ranks elements
NAMED_DIFFERENCES: dict[tuple[int, str, str, int], int] = {(2, "none", "grads_after_backward", 1): PADDING_BYTES}


def _inventories(engine: str, stage: int, offload: str) -> dict[int, dict]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with socket.socket() as sock:  # a free port for the ranks' store (bench.run.ranks does the same)
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", "--master_port", port, "-m", "tests.deepspeed_ranks", engine,
                           str(stage), offload], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    lines = [json.loads(line.split("INVENTORY ", 1)[1]) for line in done.stdout.splitlines()
             if line.startswith("INVENTORY ")]
    assert len(lines) == 2, done.stdout[-2000:] + done.stderr[-3000:]
    return {line.pop("rank"): line for line in lines}


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed (make install installs it: "
                                              "DS_BUILD_OPS=0 pip install deepspeed==0.19.8; it runs on the CPU with "
                                              "DS_ACCELERATOR=cpu)")
# two torchrun launches each, one importing DeepSpeed (35-45 s on 2 busy cores): .ci/run's step "slow: real ranks of
# cp, float8 and DeepSpeed" runs all four, and make test keeps inside its 10 minutes
@pytest.mark.slow
@pytest.mark.parametrize("stage,offload", [(3, "none"), (2, "none"), (2, "cpu"), (3, "cpu")])
def test_deepspeed_itself_keeps_what_the_mechanism_keeps(stage, offload):
    """Each rank's bytes by what they are (the 16-bit parameters, the float32 masters, the gradients after backward,
    the optimizer state, ZeRO-3's bucket, float32 gradient buffer and persistent parameters), DeepSpeed's engine
    against membench's zero2/zero3 on the same model and batch: equal, or the difference named."""
    deepspeed, membench = _inventories("deepspeed", stage, offload), _inventories("membench", stage, offload)
    assert PADDING_BYTES == 8
    for rank in (0, 1):
        expected = {entry: value - NAMED_DIFFERENCES.get((stage, offload, entry, rank), 0)
                    for entry, value in deepspeed[rank].items()}
        assert membench[rank] == expected, (rank, deepspeed[rank], membench[rank])


def test_make_install_builds_the_deepspeed_the_mechanism_follows_after_torch():
    """The set-up installs, after the pinned torch and without building its kernels, the DeepSpeed release whose
    engine strategies/framework/deepspeed_zero.py follows, so that the check above runs on a clean clone (CI)."""
    import re

    makefile = (ROOT / "Makefile").read_text()
    pinned = re.search(r"^DEEPSPEED \?= deepspeed==(\S+)$", makefile, re.M).group(1)
    recipe = re.search(r"^\$\(STAMP\):.*\n((?:\t.*\n)+)", makefile, re.M).group(1).splitlines()
    torch_line = next(i for i, line in enumerate(recipe) if '"$(TORCH)"' in line)
    deepspeed_line = next(i for i, line in enumerate(recipe) if '"$(DEEPSPEED)"' in line)
    assert torch_line < deepspeed_line and "DS_BUILD_OPS=0" in recipe[deepspeed_line]
    followed = (ROOT / "strategies" / "framework" / "deepspeed_zero.py").read_text()
    assert f"follows DeepSpeed {pinned} " in followed
    if HAS_DEEPSPEED:
        assert importlib.metadata.version("deepspeed") == pinned


def test_a_zero3_step_stopped_inside_a_module_leaves_torchs_linear_in_place():
    # a plan candidate stopped once over its limit raises inside a module's forward, where ZeRO-3's linear is in
    # place: the process's later cases (a plan worker's next candidates) must run torch's own
    from strategies.framework.deepspeed_zero3 import _TORCH_LINEAR

    class Stopped(Exception):
        pass

    def stop_at_a_linear(module, args):
        if isinstance(module, torch.nn.Linear):
            raise Stopped()

    hook = torch.nn.modules.module.register_module_forward_pre_hook(stop_at_a_linear)
    try:
        with fake_process_group(2, 0), pytest.raises(Stopped):
            tracked_step(_case(ZERO3), ZERO3, "cpu", ranks=2, cuda_autocast=False)
        assert torch.nn.functional.linear is _TORCH_LINEAR
    finally:
        hook.remove()
        torch.nn.functional.linear = _TORCH_LINEAR
