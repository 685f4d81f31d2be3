"""`membench.estimate`: the predicted peak memory of one training step of the user's model on a named GPU (or the
exact one on the CPU), without running it at full size, as `python -m bench predict` predicts it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from bench.cli.arguments import csv_list, headroom_fraction
from bench.core.gpus import capability_for
from bench.core.units import MiB
from bench.run.isolation import process_state
from bench.run.preflight import check_choice, check_output_dir, parse_batch_size
from membench import _engine
from membench.workload import InputError, check_inputs, parsed, workload_from_callables
from strategies import PHASES, parse_strategy
from workloads import Workload, get_workload

DEVICES = ("cpu", "cuda")

# predict's columns -> the breakdown's names
BREAKDOWN = {"weights": "predicted_weights_bytes", "grads": "predicted_grads_bytes",
             "optimizer_state": "predicted_optimizer_state_bytes", "activations": "predicted_activations_bytes",
             "logits": "predicted_logits_bytes", "communication": "predicted_communication_bytes",
             "other": "predicted_other_bytes"}


@dataclass
class Estimate:
    """One predicted step: `allocated_bytes` (torch.cuda.max_memory_allocated on CUDA, the exact live tensor bytes on
    the CPU), `reserved_bytes` (max_memory_reserved; None on the CPU), `breakdown` (bytes at the peak by category:
    weights, grads, optimizer_state, activations, logits, communication, other), `attention_kernel` (the kernel
    CUDA would run for scaled_dot_product_attention, on the fake-CUDA engine), `engine`, `status` and `message`;
    `row` is the whole row of the predict table (`python -m bench predict`'s CSV).

    Example:
        >>> e = estimate(lambda: torch.nn.Linear(8, 8), (torch.ones(4, 8), torch.zeros(4, 8)),
        ...              torch.nn.functional.mse_loss, name="doc_estimate")
        >>> e.allocated_bytes > 0 and e.fits(2**30)
        True
    """

    workload: str
    strategy: str
    device: str
    batch_size: int
    gpu: str | None
    allocated_bytes: int | None
    reserved_bytes: int | None
    breakdown: dict[str, int]
    attention_kernel: str | None
    engine: str | None
    status: str
    message: str
    row: dict = field(repr=False, default_factory=dict)
    job: Any = field(repr=False, default=None)  # config=: the bench.jobs.DerivedJob the case was derived from

    @property
    def peak_bytes(self) -> int | None:
        """The figure judged against a memory size: reserved bytes on CUDA (what the allocator holds), else the
        allocated (exact) bytes."""
        return self.reserved_bytes if self.reserved_bytes is not None else self.allocated_bytes

    def fits(self, target: str | int, headroom: float = 0.0) -> bool:
        """Whether the step fits `target`: a GPU's name (`"RTX 4090"`: its memory less the CUDA context that
        `plan` counts, 500 MiB, judged against the reserved bytes) or a number of bytes; `headroom` is a fraction
        of it kept free. False when nothing was predicted.

        Example: `estimate(...).fits("H100")`, `estimate(...).fits(8 * 2**30, headroom=0.05)`."""
        headroom = parsed("headroom", headroom_fraction, str(headroom))  # as `plan --headroom`
        if isinstance(target, str):
            gpu = parsed("target", _engine.gpu_named, target)
            limit = gpu.memory_bytes * (1 - headroom) - _engine.gpus.CUDA_CONTEXT_BYTES
        elif isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target < float("inf"):
            raise InputError(f"target: {target!r}; give a GPU's name (`plan --list-gpus`) or a number of bytes")
        else:
            limit = int(target) * (1 - headroom)
        if self.peak_bytes is None:
            return False
        return self.peak_bytes <= limit

    def __str__(self) -> str:
        if self.allocated_bytes is None:
            return f"{self.strategy}: {self.status} ({self.message})"
        where = self.gpu or self.device
        reserved = f", reserved {self.reserved_bytes / MiB:,.1f} MiB" if self.reserved_bytes is not None else ""
        parts = ", ".join(f"{k} {v / MiB:,.1f}" for k, v in self.breakdown.items() if v)
        return (f"{self.strategy} on {where}, batch {self.batch_size}: allocated {self.allocated_bytes / MiB:,.1f} MiB"
                f"{reserved} ({parts} MiB)" + (f"; attention: {self.attention_kernel}" if self.attention_kernel else ""))


def as_workload(model: Any, batch: Any = None, loss_fn: Callable | None = None, optimizer: Callable | None = None,
                name: str = "my_model", **kwargs: Any) -> Workload:
    """The workload the API's functions run: `model` itself when it is a Workload or a workload spec
    (`"hf:gpt2:layers=2"`), else one made from the callables (`workload_from_callables`) and checked on fake
    tensors (`check_inputs`)."""
    if isinstance(model, Workload):
        return model
    if isinstance(model, str):
        return parsed("model", get_workload, model)
    workload = workload_from_callables(model, batch, loss_fn, optimizer, name=name, **kwargs)
    check_inputs(workload)
    return workload


def target_device(gpu: str | None, device: str | None,
                  capability: str | tuple[int, int] | None) -> tuple[str, str | None, tuple[int, int] | None]:
    """(device, the GPU's name, compute capability) for a `gpu` name of bench.core.gpus, or a `device`; each parsed
    as `predict --gpu/--device/--capability` parses it (a capability `"9.0"` or `(9, 0)`), an InputError naming the
    argument otherwise."""
    found = None if gpu is None else parsed("gpu", _engine.gpu_named, gpu)
    if found is not None and device not in (None, "cuda"):
        raise InputError(f"device: {device!r} with gpu={gpu!r}; a GPU's estimate is on cuda")
    device = parsed("device", check_choice, "device", "cuda" if found else device or "cpu", DEVICES, "device")
    return device, found.name if found else None, parsed("capability", capability_for, capability, device, found,
                                                          "capability")


def strategy_specs(strategies: str | Sequence[str]) -> list[str]:
    """The strategy specs of `strategies`: one spec, a comma list as `--strategies` takes it, or a sequence of
    specs; each parsed as the command line parses it, an InputError naming it otherwise."""
    given = csv_list(strategies) if isinstance(strategies, str) else list(strategies)
    if not given:
        raise InputError(f"strategies: {strategies!r} names no strategy; give one (\"baseline\", "
                         "\"checkpoint+amp\") or a list of them")
    if not all(isinstance(spec, str) for spec in given):
        raise InputError(f"strategies: {strategies!r}; give strategy specs as text, e.g. [\"baseline\", \"amp\"]")
    for spec in given:
        parsed("strategies", parse_strategy, spec)
    return given


def batch_size_of(batch_size: Any, workload: Workload) -> int:
    """`batch_size` parsed as `--batch-size` (one positive whole number: 0 is no batch, never the default), or
    the workload's own where None."""
    if batch_size is None:
        return workload.default_batch_size
    return parsed("batch_size", parse_batch_size, batch_size, "batch_size")


def config_job(config: Any, overrides: Sequence[str] = (), peft_config: Any = None, quantization_config: Any = None,
               model: Any = None):
    """The bench.jobs.DerivedJob of `config=` (a trainer configuration file's path, or a TrainingArguments/SFTConfig
    object with `peft_config` and `quantization_config` beside it); `model`, where a string (a preset, a config.json,
    `hf:...`), replaces the configuration's model. A UsageError (InputError's parent) names a bad key."""
    from bench.jobs import derive_job

    named = model if isinstance(model, str) else None
    return derive_job(config, overrides, model=named, peft_config=peft_config,
                      quantization_config=quantization_config)


def estimate(model: Callable[[], nn.Module] | nn.Module | Workload | str | None = None, batch: Any = None,
             loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
             optimizer: Callable[[Any], torch.optim.Optimizer] | None = None, *,
             strategies: str | Sequence[str] = "baseline", gpu: str | None = None, device: str | None = None,
             capability: str | tuple[int, int] | None = None, batch_size: int | None = None, phase: str = "train",
             engine: str = "auto", snapshot_dir: str | None = None, name: str = "my_model", config: Any = None,
             overrides: Sequence[str] = (), peft_config: Any = None, quantization_config: Any = None,
             **workload_options: Any) -> Estimate | list[Estimate]:
    """The predicted peak of one steady-state training step (or `phase="eval"` forward), per strategy.

    `model` is a function building the model (built on fake tensors: nothing full-size is allocated), a model, a
    Workload or a workload spec; `batch` one `(inputs, target)` (tensors or `membench.Shape`s); `loss_fn(output,
    target)`; `optimizer(params)` a factory (default Adam). `gpu` names a GPU of `python -m bench plan --list-gpus`
    (its compute capability picks the attention kernel), else `device` is `cpu` (exact) or `cuda`; `capability`
    overrides it (`"9.0"` or `(9, 0)`, as `--capability`). `strategies` is one spec (`"checkpoint+amp"`: returns one
    Estimate) or a list, or a comma list as `--strategies` takes it (returns one per spec). Every argument is
    parsed as the command line parses its option: a bad value is an InputError naming it. `snapshot_dir`: each
    prediction's memory snapshot is written there (PyTorch's format). `workload_options` go to
    `workload_from_callables` (batch_fn, checkpoint_units, importable_as, seed).

    `config`: your trainer's configuration instead of a model and strategies: a file (Trainer/TRL, torchtune or
    axolotl YAML or JSON; `overrides` as `tune run` takes them) or a TrainingArguments/SFTConfig object with
    `peft_config` (peft's LoraConfig) and `quantization_config` (BitsAndBytesConfig) beside it; `model` (a preset
    or config.json path) then replaces the configuration's model, `batch_size` its batch. The Estimate's `job` says
    what every key became (docs/from-your-config.md).

    Example:
        >>> build = lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        >>> batch = (torch.randn(32, 64), torch.randint(10, (32,)))
        >>> e = estimate(build, batch, torch.nn.functional.cross_entropy, gpu="RTX 4090", name="doc_mlp")
        >>> e.device, e.gpu, e.fits("RTX 4090")
        ('cuda', 'RTX 4090', True)
    """
    job = None
    if config is not None:
        job = config_job(config, overrides, peft_config, quantization_config, model)
        model, strategies, batch_size = job.workload, job.strategy, batch_size or job.batch_size
    if model is None:
        raise InputError("model: give a model (a function building it, a workload spec) or config=")
    device, gpu_name, capability = target_device(gpu, device, capability)
    phase = parsed("phase", check_choice, "phase", phase, PHASES, "phase")
    engine = parsed("engine", check_choice, "engine", engine, _engine.predict.ENGINES, "engine")
    one = isinstance(strategies, str) and "," not in strategies
    specs = strategy_specs(strategies)
    if snapshot_dir is not None:
        snapshot_dir = str(parsed("snapshot_dir", check_output_dir, snapshot_dir, "snapshot_dir"))
    workload = as_workload(model, batch, loss_fn, optimizer, name, **workload_options)
    size = batch_size_of(batch_size, workload)
    data = workload.data_sources[0]
    cases = [_engine.Case(workload.spec(), spec, phase, size, device, data=data) for spec in specs]
    with process_state():  # the user's model is built and stepped here: its global changes do not outlive the call
        rows = _engine.predict_rows(cases, capability, engine, snapshot_dir)
    estimates = [_estimate_of(row, gpu_name) for row in rows]
    for one_estimate in estimates:
        one_estimate.job = job
    return estimates[0] if one else estimates


def _estimate_of(row: dict, gpu: str | None) -> Estimate:
    breakdown = {name: int(row[column]) for name, column in BREAKDOWN.items() if row.get(column) is not None}
    return Estimate(row["workload"], row["strategy"], row["device"], int(row["batch_size"]), gpu,
                    row.get("predicted_bytes"), row.get("predicted_reserved_bytes"), breakdown,
                    row.get("sdpa_kernel"), row.get("engine"), row["status"], row.get("message") or "", row)
