"""Tensor parallelism (`tp:degree=N`, strategies/tp.py) on CPU ranks: verified against one process on the global
batch, predicted per rank in one process (PyTorch's fake process group, CPU engine) equal to real gloo ranks to the
byte, alone and as `fsdp+tp` on a 2 x 2 mesh; its collectives' buffers filed as communication; each rank's weights
1/degree of the split projections plus the replicated norms; and the models or meshes it cannot split as
`unsupported` rows naming why."""

from __future__ import annotations

import functools

import pytest

from bench.analysis.fake_engine import tracked_step
from bench.analysis.predict import predict_case
from bench.core.memory_categories import COMMUNICATION
from bench.run.case import Case
from bench.run.isolation import RunOptions
from bench.run.ranks import fake_process_group
from bench.run.runner import run_case
from cli_helpers import main_in_process, one_line_exit_2

pytest.importorskip("transformers")

LLAMA = "hf:tiny-llama:seq_len=16"  # 4 attention heads, 2 key/value heads, MLP 64, vocabulary 512: degree 2 divides all
NO_SEQUENCE_OR_LOSS_PARALLEL = "tp:degree=2:sequence_parallel=false:loss_parallel=false"


def _case(spec: str, workload: str = LLAMA, batch: int = 4) -> Case:
    return Case(workload, spec, "train", batch, "cpu", data="synthetic", warmup=0, steps=1)


@functools.lru_cache(maxsize=None)
def _measured(spec: str, ranks: int) -> dict:
    return run_case(_case(spec), env={}, options=RunOptions(threads=1, ranks=ranks))


def _predicted_ranks(spec: str, ranks: int, record_events: bool = False) -> list:
    steps = []
    for rank in range(ranks):
        with fake_process_group(ranks, rank):
            steps.append(tracked_step(_case(spec), spec, "cpu", ranks=ranks, cuda_autocast=False,
                                      record_events=record_events))
    return steps


EXACT_COLUMNS = {"params": "peak_params_bytes", "grads": "peak_grads_bytes",
                 "optimizer_state": "peak_optimizer_bytes", COMMUNICATION: "peak_communication_bytes"}


@pytest.mark.parametrize("spec,ranks", [
    pytest.param("tp:degree=2", 2, marks=pytest.mark.slow),  # in .ci/run's long tests of make test
    pytest.param(NO_SEQUENCE_OR_LOSS_PARALLEL, 2, marks=pytest.mark.slow),
    pytest.param("fsdp+tp:degree=2", 4, marks=pytest.mark.slow),  # a 2 x 2 mesh: FSDP2 over dp, TP inside
])
def test_the_one_process_prediction_equals_the_real_ranks_to_the_byte(spec, ranks):
    """Real gloo ranks (`compare --ranks N --device cpu`): the same result as one process on the global batch; and
    `predict --ranks N` (each rank in turn in this process) equal to them, each rank's peak to the byte, and the
    largest rank's weights, gradients, optimizer state and communication too."""
    measured = _measured(spec, ranks)
    assert measured["status"] == "ok", measured["message"]
    assert measured["ranks"] == ranks and measured["matches_baseline"] is True, measured
    steps = _predicted_ranks(spec, ranks)
    assert min(step.peak_bytes for step in steps) == measured["rank_peak_min_bytes"]
    assert max(step.peak_bytes for step in steps) == measured["rank_peak_max_bytes"]
    largest = max(steps, key=lambda step: step.peak_bytes).peak_by_category
    for category, column in EXACT_COLUMNS.items():
        assert largest.get(category, 0) == measured[column], (category, largest, measured)
    predicted = predict_case(_case(spec), engine="cpu", ranks=ranks)  # the command's own path
    assert predicted["predicted_bytes"] == measured["rank_peak_max_bytes"], predicted


def _parameter_elements(workload: str = LLAMA) -> tuple[int, int]:
    """(the elements of the parameters tp splits, those of the norms it replicates)."""
    from workloads import get_workload

    model = get_workload(workload).model_structure()
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    return sum(p.numel() for p in model.parameters()) - norms, norms


def test_each_rank_holds_half_the_split_weights_and_its_collectives_buffers_are_communication():
    """On 2 ranks each holds half of every projection, of the embedding and of the LM head, and all of each norm,
    in float32, with Adam's two moments of the same; the forward's all-gathers and reduce-scatters (sequence
    parallelism) and the backward's allocate buffers filed as communication."""
    split, norms = _parameter_elements()
    steps = _predicted_ranks("tp:degree=2", 2, record_events=True)
    assert steps[0].peak_bytes == steps[1].peak_bytes
    step = steps[0]
    assert step.peak_by_category["params"] == 4 * (split // 2 + norms)
    assert step.peak_by_category["optimizer_state"] >= 2 * 4 * (split // 2 + norms)
    window = max(i for i, event in enumerate(step.events) if event.kind == "reset")
    communication = {event.stage for event in step.events[window:]
                     if event.kind == "alloc" and event.category == COMMUNICATION}
    assert {"forward", "backward"} <= communication, communication


@pytest.mark.parametrize("spec,ranks,workload,named", [
    ("tp:degree=2", 2, "gpt_mini:layers=2:width=32:heads=2:seq_len=16:dropout=0.0", "tp needs a Llama-layout model"),
    ("tp:degree=4", 4, LLAMA, "does not divide the model's num_key_value_heads (2)"),
    ("tp:degree=3", 4, LLAMA, "tp:degree=3 does not divide --ranks 4; valid choices: 1, 2, 4"),
    ("tp:degree=2", 4, LLAMA, "leaves 2 data-parallel replicas whose gradients nothing averages"),
    ("tp:degree=2", 2, "hf:tiny-llama:seq_len=15", "with sequence_parallel needs a sequence length it divides, not 15"),
    ("fsdp:replicate=2+tp:degree=2", 4, LLAMA, "hybrid sharding over a dp x tp mesh is not supported"),
])
def test_what_it_cannot_split_is_an_unsupported_row_naming_why(spec, ranks, workload, named):
    row = predict_case(_case(spec, workload, batch=4), engine="cpu", ranks=ranks)
    assert row["status"] == "unsupported" and named in row["message"], row


def test_a_bad_degree_is_one_line_and_exit_2(tmp_path):
    done = main_in_process("predict", "--workload", LLAMA, "--strategies", "tp:degree=0", "--ranks", "2",
                           "--device", "cpu", "--phases", "train", "--batch-size", "4", "--out", tmp_path)
    one_line_exit_2(done, "tp:degree=0", "at least 1")


def test_it_composes_with_fsdp_on_one_mesh_and_with_no_other_sharding_or_backward():
    from bench.core.errors import UsageError
    from strategies import parse_strategy

    composed = parse_strategy("fsdp+tp:degree=2")
    assert [m.name for m in composed.members] == ["tp", "fsdp"]  # tp splits the model, then fsdp shards its DTensors
    assert composed.members[0].data_parallel_place(3, 4) == (1, 2)  # rank 3 of a 2 x 2 mesh: the second dp slice
    for spec, named in [("ddp+tp", "both split the training across the ranks"),
                        ("ddp+fsdp", "both split the training across the ranks"),
                        ("tp+amp", "both replace backward")]:
        with pytest.raises(UsageError, match=named):
            parse_strategy(spec)


@pytest.mark.parametrize("spec,ranks,workload,traced", [
    # equal shards, the same batch, 8 tokens each: one rank (the default run's to-the-byte test covers it too:
    # predict's figure, from the one rank traced, equals the largest real rank's)
    pytest.param("tp:degree=2", 2, LLAMA, (0,), marks=pytest.mark.slow),
    pytest.param("fsdp+tp:degree=2", 4, LLAMA, (0,), marks=pytest.mark.slow),  # FSDP's even chunks over dp
])
def test_one_rank_of_each_signature_gives_every_ranks_largest_peak(spec, ranks, workload, traced):
    case = _case(spec, workload)
    shortcut = tracked_step(case, spec, "cpu", ranks=ranks, cuda_autocast=False)
    every = tracked_step(case, spec, "cpu", ranks=ranks, cuda_autocast=False, every_rank=True)
    assert every.ranks_traced == tuple(range(ranks)) and shortcut.ranks_traced == traced
    assert shortcut.peak_bytes == every.peak_bytes
    assert shortcut.peak_by_category == every.peak_by_category
