"""A compiled prediction on fake CUDA prints its progress and its answer, none of dynamo's messages about membench's
own module hooks (bench.measure.quiet_tracing): hf:tiny-llama under `compile:scope=layers:loss=true` printed two
"Dynamo does not know how to trace the builtin" warnings and two "hit config.recompile_limit" blocks (about 25
lines) before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# a compiled step of a 2-layer Llama in a new process: about 20 s of CPU (the fake-CUDA run is not `make test`)
def test_a_compiled_prediction_prints_nothing_of_dynamos_trouble_with_membenchs_hooks(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench", "predict", "--workload", "hf:tiny-llama:seq_len=128",
                           "--batch-size", "2", "--phases", "train", "--strategies",
                           "bf16_weights+compile:scope=layers:loss=true", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "fake-cuda" in done.stdout
    assert "does not know how to trace" not in done.stderr and "recompile_limit" not in done.stderr, done.stderr
    assert [line for line in done.stderr.splitlines() if not line.startswith("[")] == [], done.stderr
