"""ZeRO-3's gathered parameters against DeepSpeed itself: on 2 gloo ranks (DeepSpeed's CPU accelerator) DeepSpeed's
engine and membench's zero3 run the same tiny model three micro-batches, and after each Linear's forward the elements
gathered whole are the same, under settings where DeepSpeed frees each module's parameters, keeps them for their
backward (its default `stage3_max_reuse_distance` of 1e9 elements, larger than the model), keeps those used again
within the reuse distance, and prefetches within `stage3_max_live_parameters` (tests/deepspeed_gathered.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from strategies import STRATEGIES
from strategies.framework.deepspeed_zero3 import _TORCH_LINEAR as TORCH_LINEAR
from tests.deepspeed_gathered import MICRO_BATCHES, SETTINGS

ROOT = Path(__file__).resolve().parent.parent
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
LINEARS = 4  # tests/deepspeed_ranks.py's model: 3 layers and the head, one sample after each
# The one difference left: in its first micro-batch (its trace being recorded) DeepSpeed frees the persistent biases
# too after each module (`release_sub_module` frees all of a module's parameters while the trace is incomplete), so
# in the second it gathers them again, and they count against max_live_parameters, leaving the prefetch less room;
# membench keeps them whole throughout. From the third micro-batch on they stay gathered in DeepSpeed as well.
SECOND_MICRO_BATCH_DIFFERS = {"prefetched_within_max_live"}


def _samples(engine: str) -> dict[int, dict]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", "--master_port", port, "-m", "tests.deepspeed_gathered",
                           engine], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    lines = [json.loads(line.split("GATHERED ", 1)[1]) for line in done.stdout.splitlines()
             if line.startswith("GATHERED ")]
    assert len(lines) == 2, done.stdout[-2000:] + done.stderr[-3000:]
    return {line.pop("rank"): line for line in lines}


@pytest.mark.slow  # two torchrun launches, one importing DeepSpeed: about a minute on 2 cores
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed (make install installs it)")
def test_zero3_gathers_and_frees_what_deepspeed_does():
    deepspeed, membench = _samples("deepspeed"), _samples("membench")
    whole = 3 * 24 * 24 + 24 * 2  # the weights; the biases are persistent
    for rank in (0, 1):
        assert set(membench[rank]) == set(deepspeed[rank]) == set(SETTINGS)
        for name in SETTINGS:
            ours, theirs = membench[rank][name], deepspeed[rank][name]
            assert len(ours) == len(theirs) == MICRO_BATCHES * LINEARS, (name, ours, theirs)
            if name in SECOND_MICRO_BATCH_DIFFERS:
                ours, theirs = ours[:LINEARS] + ours[2 * LINEARS:], theirs[:LINEARS] + theirs[2 * LINEARS:]
            assert ours == theirs, (rank, name, membench[rank][name], deepspeed[rank][name])
        # the settings do make DeepSpeed free, keep and prefetch differently: the check can tell them apart
        settled = {name: deepspeed[rank][name][-LINEARS:] for name in SETTINGS}
        assert settled["freed_after_each_module"] == [0] * LINEARS
        assert settled["kept_for_the_backward"][-1] == whole
        assert 0 < max(settled["kept_within_the_reuse_distance"]) < whole
        assert max(settled["prefetched_within_max_live"]) > settled["kept_within_the_reuse_distance"][0]


def _saved_storage_bytes(loss) -> list[int]:
    """The bytes of each distinct storage autograd saved for the backward of `loss`'s graph."""
    import torch

    seen, stack, storages = set(), [loss.grad_fn], {}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        saved = [getattr(node, name) for name in dir(node) if name.startswith("_saved_")]
        saved += list(getattr(node, "saved_tensors", ()) or ())
        for tensor in saved:
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(storages.values())


def test_a_released_weight_is_not_kept_by_autograd_until_its_backward():
    """DeepSpeed's ZeRO-3 replaces F.linear with a linear that saves the weight parameter itself (runtime/zero/
    linear.py), so a weight released after its forward frees its gathered data; torch's linear saves a transposed view
    of it, which would keep every gathered weight until the backward."""
    import torch
    from torch import nn

    from bench.run.ranks import fake_process_group
    from tests.deepspeed_ranks import WIDTH, batch, model

    with fake_process_group(2, 0):
        strategy = STRATEGIES.get("zero3")(param_persistence_threshold=30, prefetch_bucket_size=0,
                                           max_reuse_distance=0, reduce_bucket_size=1000)
        net = model()
        strategy.wrap_optimizer(torch.optim.AdamW(net.parameters()), net)
        x, y = batch()
        for _ in range(2):  # the second micro-batch runs with the first's trace
            loss = nn.functional.cross_entropy(net(x), y)
            weight_bytes = WIDTH * WIDTH * 4
            assert strategy._live_elements() == 0
            assert max(_saved_storage_bytes(loss)) < weight_bytes, "a gathered weight is kept by autograd"
            strategy.backward(loss)
        assert torch.nn.functional.linear is TORCH_LINEAR  # outside the model's forward, torch's own
