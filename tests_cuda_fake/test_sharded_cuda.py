"""The sharded strategies (ddp, zero1, fsdp) on fake CUDA: each rank of a 2-rank run in turn, in this one process.

`--ranks N --device cuda` starts N processes joined by NCCL, one GPU each (bench/run/ranks.py); here one process is each
rank in turn, inside PyTorch's fake process group restricted to CUDA tensors as NCCL is
(`bench.run.ranks.fake_process_group(2, rank, device="cuda")`: collectives move no data, and one on a host tensor fails as
under NCCL), on fake CUDA tensors (fake_mode.py), through the runner's CUDA branch (`run_case` with `ranks=2`, as a
rank process runs it). Asserted for FSDP2 (and its compositions with amp and checkpoint): the row's status, every
tensor of the steps on the GPU, this rank's 1/N of the batch, of every parameter and of the optimizer state (local
shards of DTensors, on the GPU), autocast's dtypes and GradScaler's calls, process-wide state restored. ZeRO-1's
optimizer sharding runs through its own hook. DistributedDataParallel (ddp, and zero1, which trains a DDP model)
cannot run on fake tensors: `test_ddp_stops_at_its_host_bookkeeping` pins where and why (docs/testing.md "What it
cannot check"). A rank process's start (`join_process_group`: its GPU, then NCCL) runs with one rank; the NCCL
communicator itself, one GPU a rank and real collectives need GPUs.
"""

from __future__ import annotations

import math
import subprocess
import sys
from functools import lru_cache

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from bench.run import isolation
from bench.run.isolation import RunOptions
from bench.run.ranks import fake_process_group
from bench.run.case import Case, bind_case
from bench.run.runner import Session, run_case
from strategies import STRATEGIES
from tests_cuda_fake.fake_mode import fake_cuda
from tests_cuda_fake.test_cuda_path import FP32_UNDER_AUTOCAST, MATMULS, WORKLOADS, components
from workloads import get_workload

RANKS = 2
BATCH = 4  # 2 samples a rank: BatchNorm in training needs more than one value per channel
SHARDED = [name for name in STRATEGIES.names() if STRATEGIES.get(name).distributed]

# Why DistributedDataParallel needed help to run on fake tensors: its C++ side makes host tensors of its own and reads
# or writes their data. Under FakeTensorMode (a dispatch mode, which sees the C++ side's `at::empty` too) those are
# fake and have no storage. torch/csrc/distributed/c10d/reducer.cpp: `verify_params_across_processes` (called by
# DistributedDataParallel.__init__ through `_verify_param_shape_across_processes`) fills `metadata.accessor<>()`, and
# `Reducer::sync_bucket_indices` (from `_rebuild_buckets`, before the second step's forward) fills
# `indices_tensor.accessor<>()`. strategies/framework/sharding.py goes around both on fake tensors: the cross-rank
# check is skipped (in one process every rank is this one) and the rebuild files the first buckets as the new ones.
NO_STORAGE = "its data is not allocated yet"
# this file's per-rank checks look at FSDP's shards (DTensors); DDP and ZeRO-1 replicate the model
CANNOT_RUN = {"ddp": "replicates the model: no shards to check", "zero1": "trains a DDP model: no shards to check",
              "tp": "splits Llama-layout transformers models only, none in this grid: test_tp_fake_cuda.py runs it",
              "cp": "splits Llama-layout transformers models' sequences, none in this grid: test_cp_fake_cuda.py",
              "zero2": "DeepSpeed's partitions are plain tensors: test_deepspeed_zero_fake_cuda.py checks them",
              "zero3": "DeepSpeed's partitions are plain tensors: test_deepspeed_zero_fake_cuda.py checks them"}


def sharded_cases() -> list[tuple[str, str]]:
    """(workload, spec): every sharded strategy on every built-in workload; its compositions with amp and (FSDP's)
    checkpoint on the transformer (attention, layer norm) and the U-Net (convolutions, BatchNorm)."""
    cases = [(workload, name) for name in SHARDED for workload in WORKLOADS]
    for workload in ("gpt_mini", "unet"):
        cases += [(workload, f"{name}+amp") for name in SHARDED]
        cases += [(workload, "fsdp+checkpoint")]
    return cases


@lru_cache(maxsize=1)
def streams_and_events_missing() -> str | None:
    """Why FSDP2 cannot run here (it all-gathers on CUDA streams of its own, synchronised by CUDA events), or None:
    stubs built before bench/measure/cuda_stubs.py answered those calls refuse them. Asked in a fresh process, since
    a refused stream would leave torch's stream pool half made in this one."""
    probe = "import torch; torch.cuda.Event(enable_timing=True).record(torch.cuda.Stream(priority=-1))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if done.returncode == 0:
        return None
    return ("the stub CUDA libraries do not answer CUDA streams and events (built before cuda_stubs.py did): "
            "`make cuda-fake-env` rebuilds them")


@pytest.fixture
def sessions(monkeypatch) -> list[Session]:
    """Every Session the runner builds while the test runs (its passes' models, batches and optimizers)."""
    built: list[Session] = []
    constructor = Session.__init__

    def recorded(self, *args, **kwargs):
        constructor(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(Session, "__init__", recorded)
    return built


def process_state() -> dict:
    """What one case must leave as it found it: the process-wide flags, autocast, the process group, fake mode."""
    return {**isolation._flags(), "autocast": torch.is_autocast_enabled("cuda"),
            "process_group": dist.is_initialized(),
            "fake_mode": torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None,
            "mesh_constructor": torch.distributed.device_mesh.DeviceMesh.__init__}


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2's parameters, gradients and optimizer state), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def row_elements(tensor: torch.Tensor) -> int:
    """The elements of one index of a tensor's first dimension (FSDP2 shards along it, in torch.chunk's pieces)."""
    return math.prod(tensor.shape[1:])


@pytest.mark.parametrize("workload,spec", sharded_cases())
def test_sharded_case_runs_on_fake_cuda_as_each_rank(workload, spec, sessions):
    used = components(spec)
    cannot = [CANNOT_RUN[name] for name in used if name in CANNOT_RUN]
    if cannot:
        pytest.skip(cannot[0])
    if streams_and_events_missing():
        pytest.skip(streams_and_events_missing())
    state_before = process_state()
    case = Case(WORKLOADS[workload], spec, "train", BATCH, "cuda", data="synthetic", warmup=0, steps=1)
    local_elements = []
    for rank in range(RANKS):
        sessions.clear()
        with fake_cuda(record=True) as (scaler, record), fake_process_group(RANKS, rank, device="cuda"):
            row = run_case(case, None, RunOptions(threads=1, ranks=RANKS), verify_result=False)
            assert row["status"] == "ok", f"rank {rank}: {row['message']}"
            assert row["memory_method"] == "cuda_max_memory_allocated" and row["peak_mem_bytes"] > 0

            on_host = {op for op, devices in record.devices.items() if "cpu" in devices}
            assert not on_host, f"rank {rank}: operators on host tensors during the steps: {sorted(on_host)}"
            matmul_dtypes = set().union(*(record.forward_dtypes.get(op, set()) for op in MATMULS))
            if "amp" in used:
                assert matmul_dtypes == {torch.float16}, f"autocast float16 gave {matmul_dtypes}"
                for op in FP32_UNDER_AUTOCAST:
                    assert record.forward_dtypes.get(op, {torch.float32}) <= {torch.float32}, op
                steps = 1 + 2  # the timing pass's step, the memory pass's warm-up and measured steps
                assert scaler.steps >= steps and scaler.scaled >= steps and scaler.unscaled == scaler.steps
            else:
                assert matmul_dtypes == {torch.float32}, matmul_dtypes
                assert scaler.scaled == scaler.steps == 0

            session = sessions[-1]  # the memory pass's
            assert all(len(t) == BATCH // RANKS and t.is_cuda for t in session.batch_tensors()), "this rank's batch"
            parameters = session.parameters()
            shards = [local(p) for p in parameters]
            assert all(isinstance(p, DTensor) for p in parameters), "a parameter FSDP did not shard"
            assert all(s.is_cuda for s in shards), "a parameter shard off the GPU"
            local_elements.append(sum(s.numel() for s in shards))
            full = sum(p.numel() for p in parameters)
            # torch.chunk's pieces: each rank holds half of every parameter, give or take half of one index's row
            assert abs(local_elements[-1] - full / RANKS) <= sum(row_elements(p) for p in parameters) / RANKS
            optimizer = session.optimizer
            for p in parameters:
                moments = [v for v in optimizer.state[p].values() if isinstance(v, torch.Tensor) and v.dim() > 0]
                assert moments, "a parameter without optimizer state"
                for moment in moments:  # Adam's two moments: this rank's shard, on the GPU
                    assert local(moment).shape == local(p).shape and local(moment).is_cuda
    assert sum(local_elements) == full, "the ranks' shards do not add up to the model"
    assert process_state() == state_before, "process-wide state was left changed"


def test_the_loss_across_ranks_travels_on_the_gpu():
    """The verification pass (`reduce_loss`) all-reduces the ranks' losses: under NCCL a host tensor has no
    backend ("No backend type associated with device type cpu"), which is what the CUDA-only fake group says too."""
    if streams_and_events_missing():
        pytest.skip(streams_and_events_missing())
    case = Case(WORKLOADS["deep_mlp"], "fsdp", "train", BATCH, "cuda", data="synthetic", warmup=0, steps=1)
    for rank in range(RANKS):
        with fake_cuda(), fake_process_group(RANKS, rank, device="cuda"):
            row = run_case(case, None, RunOptions(threads=1, ranks=RANKS), verify_result=True)
        assert row["status"] == "ok", f"rank {rank}: {row['message']}"
        # the verification's step ran, all-reduce included; its placeholder values are not compared
        assert row["message"].startswith("not verified: the step ran on fake tensors"), row["message"]


@pytest.mark.parametrize("workload", ["deep_mlp", "gpt_mini"])
def test_zero1_shards_the_optimizer_state_on_the_gpu(workload):
    """ZeRO-1's own hook (`wrap_optimizer`) on fake CUDA parameters: each rank steps and keeps the state of a part
    of the parameters, the ranks' parts cover every parameter once (its DDP model cannot run here: see above)."""
    spec = WORKLOADS[workload]
    owned_by_rank, total = [], None
    for rank in range(RANKS):
        with fake_cuda(), fake_process_group(RANKS, rank, device="cuda"):
            strategy, _ = bind_case(Case(spec, "zero1", "train", BATCH, "cuda"), RANKS)
            model = get_workload(spec).build_model().to("cuda")
            optimizer = strategy.wrap_optimizer(get_workload(spec).make_optimizer(model), model)
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            optimizer.step()
            index = {id(p): i for i, p in enumerate(model.parameters())}
            owned = {index[id(p)] for group in optimizer.optim.param_groups for p in group["params"]}
            sizes = [p.numel() for p in model.parameters()]
            total = sum(sizes)
            for p, state in optimizer.optim.state.items():
                moments = [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
                assert len(moments) == 2 and all(m.is_cuda and m.shape == p.shape for m in moments)
            assert set(index[id(p)] for p in optimizer.optim.state) == owned, "state of a parameter it does not own"
            assert 0 < sum(sizes[i] for i in owned) < total, f"rank {rank} owns {len(owned)} of {len(sizes)}"
            owned_by_rank.append(owned)
    assert set.union(*owned_by_rank) == set(range(len(sizes))) and not set.intersection(*owned_by_rank)


def test_ddp_runs_on_fake_cuda_past_its_host_bookkeeping():
    """DistributedDataParallel on fake CUDA tensors (see NO_STORAGE above): constructed without the cross-rank shape
    check, its gradient buckets on the GPU; two steps run, the second forward's bucket rebuild filing the first
    buckets as the communication buffers it would allocate (their bytes: every parameter's)."""
    from bench.core.memory_categories import COMMUNICATION
    from bench.measure import breakdown

    if streams_and_events_missing():  # the reducer times its steps with CUDA events
        pytest.skip(streams_and_events_missing())
    case = Case(WORKLOADS["deep_mlp"], "ddp", "train", BATCH, "cuda", data="synthetic", warmup=0, steps=1)
    with fake_cuda(), fake_process_group(RANKS, 0, device="cuda"):
        strategy, _ = bind_case(case, RANKS)
        session = Session(case, strategy)
        buckets = [bucket.buffer() for bucket in session.model.reducer._get_zeros_like_grad_buckets()]
        assert all(b.is_cuda and b.dtype == torch.float32 for b in buckets), "a gradient bucket off the GPU"
        parameter_values = sum(p.numel() for p in session.parameters())
        assert sum(b.numel() for b in buckets) == parameter_values
        tracker = breakdown.CategorizedTracker("cuda")
        with tracker:
            for _ in range(2):
                session.forward_backward()
                strategy.optimizer_step(session.optimizer)
                strategy.zero_grad(session.optimizer)
        assert all(p.grad is None or p.grad.is_cuda for p in session.parameters())
        assert session.model.reducer._rebuilt
        assert tracker.live_by_category[COMMUNICATION] == 4 * parameter_values


def test_fsdp_on_the_cpu_stays_on_the_cpu_where_torch_sees_a_gpu(sessions):
    """FSDP2 without a mesh takes torch's default accelerator and moves the model there: a `--device cpu` case on a
    machine with a GPU trained on the GPU (here, where torch sees the stubs' device, it failed in cudaMalloc).
    The strategy gives it a mesh of the case's device."""
    case = Case(WORKLOADS["deep_mlp"], "fsdp", "train", BATCH, "cpu", data="synthetic", warmup=0, steps=1)
    assert torch.cuda.is_available()
    for rank in range(RANKS):
        sessions.clear()
        with fake_process_group(RANKS, rank):
            row = run_case(case, None, RunOptions(threads=1, ranks=RANKS), verify_result=False)
        assert row["status"] == "ok", f"rank {rank}: {row['message']}"
        assert all(not local(p).is_cuda for session in sessions for p in session.parameters())


def test_a_rank_process_joins_nccl_on_its_gpu(monkeypatch):
    """What a rank process of `--ranks N --device cuda` does first (`bench.run.ranks.join_process_group`): its GPU
    (LOCAL_RANK) made current, then NCCL. Here with one rank, since the stubs have one device: rank 1's GPU does not
    exist, so N processes cannot start. A collective on fake tensors stops at its fake implementation: NCCL's own
    code (its communicator, made at the first real collective) never runs."""
    from bench.run.ranks import _free_port, join_process_group

    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(name, value)
    join_process_group("cuda")
    try:
        assert dist.get_backend() == "nccl" and torch.cuda.current_device() == 0
        with fake_cuda():
            gradient = torch.ones(8, device="cuda")
            dist.all_reduce(gradient)
            assert gradient.is_cuda
    finally:
        dist.destroy_process_group()
    # rank 1's GPU: the stubs' cudaSetDevice refuses any device but 0 (cudaErrorInvalidDevice, which their error
    # strings, all alike, call "not supported")
    with pytest.raises(RuntimeError, match="membench fake CUDA"):
        torch.cuda.set_device(1)
    assert torch.cuda.current_device() == 0


# --- FSDP2's options on fake CUDA, predicted per rank in this one process (`predict --ranks N --device cuda`) --------

@lru_cache(maxsize=None)  # fsdp's own prediction is the reference of several tests
def _predicted(spec: str, ranks: int, workload: str = "gpt_mini", batch: int = BATCH) -> dict:
    from bench.analysis.predict import predict_case

    row = predict_case(Case(WORKLOADS[workload], spec, "train", batch, "cuda", data="synthetic"), engine="fake-cuda",
                       ranks=ranks)
    assert row["status"] == "ok" and row["engine"] == "fake-cuda", row
    assert "engine failed" not in row["message"], row["message"]
    return row


def test_fsdp_offload_keeps_the_shards_gradients_and_optimizer_state_in_host_memory(sessions):
    """`fsdp:offload=cpu` (FSDP2's CPUOffloadPolicy): each rank's shards of the parameters, their gradients and Adam's
    state are host tensors; the GPU holds the unsharded units in flight and the collectives' buffers only, and the
    row's `offload_host_peak_bytes` is at least the shards, their gradients and Adam's two moments."""
    if streams_and_events_missing():
        pytest.skip(streams_and_events_missing())
    case = Case(WORKLOADS["gpt_mini"], "fsdp:offload=cpu", "train", BATCH, "cuda", data="synthetic", warmup=0, steps=1)
    with fake_cuda(), fake_process_group(RANKS, 0, device="cuda"):
        row = run_case(case, None, RunOptions(threads=1, ranks=RANKS), verify_result=False)
    assert row["status"] == "ok", row["message"]
    session = sessions[-1]
    shards = [local(p) for p in session.parameters()]
    assert shards and all(not s.is_cuda for s in shards), "a parameter shard on the GPU"
    state = [local(v) for p in session.parameters() for v in session.optimizer.state[p].values() if v.dim() > 0]
    assert state and all(not s.is_cuda for s in state), "optimizer state on the GPU"
    shard_bytes = sum(s.untyped_storage().nbytes() for s in shards)
    assert row["offload_host_peak_bytes"] >= 4 * shard_bytes  # shards, gradients, Adam's exp_avg and exp_avg_sq

    offloaded, on_gpu = _predicted("fsdp:offload=cpu", RANKS), _predicted("fsdp", RANKS)
    assert offloaded["predicted_optimizer_state_bytes"] == 0 < on_gpu["predicted_optimizer_state_bytes"]
    assert offloaded["predicted_weights_bytes"] < on_gpu["predicted_weights_bytes"]
    assert offloaded["predicted_communication_bytes"] > 0
    assert offloaded["offload_host_peak_bytes"] >= 4 * shard_bytes


def test_hybrid_sharding_on_four_ranks_shards_over_its_replica_group():
    """`fsdp:replicate=2 --ranks 4` (HSDP: a 2 x 2 mesh, a 2-D DeviceMesh on fake CUDA): each rank keeps what full
    sharding over 2 ranks keeps, to the byte, and the all-reduce across replica groups adds its buffer."""
    if streams_and_events_missing():
        pytest.skip(streams_and_events_missing())
    hsdp, over_two = _predicted("fsdp:replicate=2", 4, batch=8), _predicted("fsdp", 2, batch=8)
    assert hsdp["ranks"] == 4
    assert hsdp["predicted_optimizer_state_bytes"] == over_two["predicted_optimizer_state_bytes"] > 0
    assert hsdp["predicted_communication_bytes"] > 0


@pytest.mark.parametrize("spec", ["fsdp+lora:targets=qkv/fc", "fsdp+lora:targets=qkv/fc+checkpoint"])
def test_fsdp_shards_lora_s_frozen_weights_and_trainable_adapters(spec):
    """LoRA's frozen base weights and trainable adapters under fully_shard: Adam's state only for the adapters
    (far below full training's), checkpointing lowering the activations further."""
    if streams_and_events_missing():
        pytest.skip(streams_and_events_missing())
    pytest.importorskip("peft")
    lora, full = _predicted(spec, RANKS), _predicted("fsdp", RANKS)
    assert 0 < lora["predicted_optimizer_state_bytes"] < full["predicted_optimizer_state_bytes"] / 4
    if "checkpoint" in spec:
        assert lora["predicted_activations_bytes"] < _predicted("fsdp+lora:targets=qkv/fc", RANKS)[
            "predicted_activations_bytes"]
