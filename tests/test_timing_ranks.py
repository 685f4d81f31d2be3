"""Adaptive timing on ranks: two real gloo processes whose steps take different times stop after the same step (the
first rank's stop), where each deciding alone left one rank in the next step's collective after the other exited
("Connection closed by peer": 2-rank CPU runs of emulated bfloat16, timed adaptively, failed that way)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_RANK = """
import json, os, sys
import torch, torch.distributed as dist
from bench.measure import timing
dist.init_process_group("gloo")
rank = dist.get_rank()
now = [0.0]
def step():
    dist.all_reduce(torch.ones(1))  # a collective in every step, as DDP's and FSDP's
    now[0] += (1.0, 3.0)[rank]  # rank 1's steps take three times rank 0's
# alternating clocks would never meet the interval's target: each rank alone stops at its budget of 6 s, rank 1
# after 2 steps, rank 0 after 6
policy = timing.TimingPolicy(warmup=1, steps=None, min_steps=1, max_time_s=6.0, target_ci_rel=-1.0)
stats = timing.time_steps(step, policy, "cpu", clock=lambda: now[0])
print(json.dumps([len(stats.times_ms), stats.stop_reason]))
dist.destroy_process_group()
"""


def test_every_rank_stops_after_the_step_the_first_rank_stops_at():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2",
                                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for rank in range(2)]
    done = [rank.communicate(timeout=240) for rank in ranks]
    for process, (out, err) in zip(ranks, done):
        assert process.returncode == 0, err[-2000:]
    assert [json.loads(out.splitlines()[-1]) for out, _ in done] == [[2, "time_budget"], [2, "time_budget"]]
