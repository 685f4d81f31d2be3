"""pytest-benchmark timings of one training step per registered strategy (`make perf`; not part of `make test`).

Compare commits with pytest-benchmark's own tools, e.g.
    make perf                                   # saves a numbered run under .benchmarks/
    .venv/bin/python -m pytest benchmarks --benchmark-enable --benchmark-compare --benchmark-compare-fail=median:10%
Each result carries the strategy's peak bytes (bench.run.runner.memory_pass) in `extra_info`.
"""

import pytest
import torch

from bench.core.errors import Unsupported
from bench.run.case import Case, bind_case
from bench.run.runner import Session, memory_pass
from strategies import STRATEGIES

BATCH_SIZE = 8
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("name", STRATEGIES.names())
def test_train_step(benchmark, name):
    case = Case("captcha_resnet18", name, "train", BATCH_SIZE, DEVICE, data="synthetic", warmup=1, steps=3)
    strategy, context = bind_case(case)
    try:
        strategy.check(context)
    except Unsupported as error:
        pytest.skip(str(error))
    memory = memory_pass(case, strategy)
    benchmark.extra_info.update(strategy=strategy.spec(), batch_size=BATCH_SIZE, device=DEVICE,
                                peak_mem_bytes=int(memory["peak_mem_bytes"]), memory_method=memory["memory_method"])
    session = Session(case, strategy)
    with strategy.session():
        if DEVICE == "cuda":
            def step():
                session.step()
                torch.cuda.synchronize()
        else:
            step = session.step
        benchmark.pedantic(step, rounds=3, iterations=1, warmup_rounds=1)
