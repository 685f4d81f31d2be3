"""Verification: a strategy's loss, gradients, stepped weights and BatchNorm statistics against the baseline's,
from the same seeded start."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_map

from bench.core import progress
from bench.measure.fake_cuda_mode import clear_on_fake_mode_change
from bench.run.case import Case, bind_case
from bench.run.session import Session
from bench.run import tensor_store
from bench.run.tensor_store import (
    FileStore, MemoryStore, Store, StoredList, StoredTensors, difference_norms, store_for, tensor_norm,
)
from strategies import Strategy
from workloads import tensors_of


class NonFiniteLoss(Exception):
    """The case's loss is NaN or infinite: its row is an `error` that says where, and no figure is measured
    (a step on non-finite values may skip work -- GradScaler skips the optimizer step -- and measure less)."""


def non_finite_loss(loss: float, where: str, reference: float | None = None) -> NonFiniteLoss:
    """The error of a case whose loss is `loss` (not finite) `where`; `reference` is the baseline's at the same
    point, when known, so that the message says whether the workload or the strategy made it."""
    text = f"loss is not finite ({loss}) {where}"
    if reference is not None:
        text += (f"; the baseline's is {reference} too: the workload's loss, not the strategy"
                 if not math.isfinite(reference) else f"; the baseline's is finite ({reference:.6g})")
    return NonFiniteLoss(text)


@dataclass
class Snapshot:
    """The result of one forward (and in training backward and one optimizer step) from the seeded start.

    Its tensors are mappings (and a sequence for the outputs): plain dicts, or views of a `tensor_store` store
    that read each tensor on access, so that a snapshot kept for a whole sweep costs no resident memory."""

    loss: float
    outputs: Sequence[torch.Tensor]
    grads: Mapping[str, torch.Tensor | None]
    buffers: Mapping[str, torch.Tensor]
    stepped: Mapping[str, torch.Tensor] = field(default_factory=dict)  # the weights after the optimizer step
    store: Any = None  # what holds the tensors (a FileStore's file lives as long as the snapshot)


def snapshot(case: Case, strategy: Strategy) -> Snapshot:
    """Forward, loss and (in training) backward and one optimizer step from a fresh session.

    Gradients are brought to true scale; a gradient that a strategy frees as soon as it exists (a step taken in
    backward) is the one seen when it was accumulated. Outputs of micro-batches are joined along the batch.
    Each tensor is written to the snapshot's store (`bench.run.tensor_store`: an unlinked temporary file) as soon
    as it is final, and no copy is kept: the process holds nothing beyond the session's own step while it runs.
    """
    # by id: a parameter as a key would make a cycle through its hook. The gradient itself, not a copy, with its
    # version: only a strategy that frees it (optimizer_in_backward) makes this hold it longer than the step does
    accumulated: dict[int, tuple[torch.Tensor, int]] = {}

    def keep_grad(param: torch.Tensor) -> None:
        accumulated[id(param)] = (param.grad, param.grad._version)

    session = Session(case, strategy, observe_grads=True)
    session.watch_grads(keep_grad)
    store = store_for(session.base_model.parameters)
    grads: list[str] = []
    no_grads: list[str] = []
    stepped: list[str] = []
    with strategy.session():
        if case.phase == "train":
            parts: list[list[torch.Tensor]] = []
            losses: list[float] = []

            def seen(output: Any, micro_loss: torch.Tensor) -> None:
                parts.append(tensors_of(_detached(output)))
                losses.append(float(micro_loss.detach()))

            session.forward_backward(seen=seen)
            loss = sum(losses)
            outputs = _store_outputs(store, [torch.cat(pieces) if len(pieces) > 1 else pieces[0]
                                             for pieces in zip(*parts)])
            del parts
            strategy.unscale_grads(session.optimizer)
            named = [(strategy.baseline_parameter_name(name), p) for name, p in session.base_model.named_parameters()]
            for name, p in named:
                grad = p.grad if p.grad is not None else _freed_grad(accumulated.get(id(p)), name)
                if grad is None:
                    no_grads.append(name)
                else:
                    store.put(("grads", name), whole(grad).detach().float().cpu())
                    grads.append(name)
            accumulated.clear()
            strategy.optimizer_step(session.optimizer)
            # `to` with a dtype, not `.float()`: a quantised weight (torchao's NF4Tensor, qlora) gives the float32
            # values it stands for, where `.float()` of its float32 face returns the subclass itself
            for name, p in named:
                store.put(("stepped", name), whole(p).detach().to("cpu", torch.float32))
                stepped.append(name)
        else:
            inputs, _ = session.batch()
            output = session.forward(inputs)
            loss = float(session.loss(output).detach())
            outputs = _store_outputs(store, tensors_of(_detached(output)))
    buffers = []
    for name, b in session.base_model.named_buffers():
        store.put(("buffers", name), b.detach().cpu())
        buffers.append(name)
    return Snapshot(strategy.reduce_loss(loss), StoredList(store, "outputs", outputs),
                    StoredTensors(store, "grads", grads, no_grads), StoredTensors(store, "buffers", buffers),
                    StoredTensors(store, "stepped", stepped), store)


def _store_outputs(store: Store, outputs: list[torch.Tensor]) -> int:
    """Writes the floating-point outputs (as float32) to `store`; returns how many."""
    floating = [t for t in outputs if t.is_floating_point()]
    for index, tensor in enumerate(floating):
        store.put(("outputs", index), whole(tensor).float())  # tensor parallelism's logits: vocabulary shards
    return len(floating)


def _freed_grad(seen: tuple[torch.Tensor, int] | None, name: str) -> torch.Tensor | None:
    """The gradient a strategy freed after it was accumulated, as it was then; None if it never had one."""
    if seen is None:
        return None
    grad, version = seen
    if grad._version != version:
        raise RuntimeError(f"the gradient of {name} was changed in place after backward and then freed: the "
                           "verification cannot see the value it had")
    return grad


def _detached(output: Any) -> Any:
    return tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, output)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a sharded one (a DTensor gathered from every rank: every rank must call this)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def baseline_snapshot(case: Case) -> Snapshot:
    """The baseline's snapshot for the case's workload, phase, batch, device and data: taken once for all the
    strategies compared with it."""
    return _baseline_snapshot(replace(case, strategy="baseline", warmup=0, steps=0, min_steps=0, max_time_s=0.0,
                                      target_ci_rel=0.0))


# Keyed by the baseline's case alone, so every strategy of a sweep shares one snapshot (it holds the gradients and the
# stepped weights: twice the model's size). Two: a sweep's cases come grouped by batch, and an emulated 16-bit case is
# verified at a smaller one (bench.run.runner.emulated_verification) between cases at the full batch.
@functools.lru_cache(maxsize=2)
def _baseline_snapshot(baseline: Case) -> Snapshot:
    return snapshot(baseline, bind_case(baseline)[0])


clear_on_fake_mode_change(_baseline_snapshot.cache_clear)

# On CUDA a strategy's difference from the baseline is judged against at least this many times the baseline's own
# difference from a second run of itself: GPU kernels are not deterministic (cuDNN's weight gradients add with
# atomics), and on an H200 captcha's baseline differed from itself by 1.5e-4 in a gradient, over the exact grad_rtol
# of 1e-4. An order of magnitude keeps every wrong result this suite catches (differences of 1e-2 and more) wrong.
DEVICE_NOISE_MULTIPLE = 10.0


@dataclass(frozen=True)
class DeviceNoise:
    """How far the baseline differs from a second run of itself on a device, per check of `compare`."""

    loss: float = 0.0
    grad: float = 0.0
    output: float = 0.0
    step: float = 0.0

    def widen(self, tol: "Tolerance") -> "Tolerance":
        """`tol` with each relative tolerance at least DEVICE_NOISE_MULTIPLE times this noise."""
        k = DEVICE_NOISE_MULTIPLE
        return replace(tol, loss_rtol=max(tol.loss_rtol, k * self.loss), grad_rtol=max(tol.grad_rtol, k * self.grad),
                       output_rtol=max(tol.output_rtol, k * self.output), step_rtol=max(tol.step_rtol, k * self.step))


def device_noise(case: Case) -> DeviceNoise:
    """The baseline's difference from itself for the case's workload, phase, batch and device: none on the CPU (its
    kernels are deterministic for a fixed thread count), measured with a second baseline run on CUDA."""
    if case.device != "cuda":
        return DeviceNoise()
    baseline = replace(case, strategy="baseline", warmup=0, steps=0, min_steps=0, max_time_s=0.0, target_ci_rel=0.0)
    return _device_noise(baseline)


@functools.lru_cache(maxsize=8)
def _device_noise(baseline: Case) -> DeviceNoise:
    strategy = bind_case(baseline)[0]
    again = compare(snapshot(baseline, strategy), _baseline_snapshot(baseline), strategy)
    return DeviceNoise(again["loss_rel_diff"], again["max_grad_rel_diff"] or 0.0, again["output_rel_diff"],
                       again["max_param_rel_diff"] or 0.0)


def compare(result: Snapshot, reference: Snapshot, strategy: Strategy, noise: DeviceNoise | None = None
            ) -> dict[str, Any]:
    """Loss, gradients and BatchNorm statistics against the baseline, and whether all are within tolerance (widened
    to DEVICE_NOISE_MULTIPLE times the baseline's own `noise` where it has some)."""
    tol = noise.widen(strategy.tolerance) if noise else strategy.tolerance
    loss_rel_diff = abs(result.loss - reference.loss) / max(abs(reference.loss), 1e-12)
    max_abs, max_rel, missing = 0.0, 0.0, 0
    # a gradient that is ~0 in exact arithmetic is judged against a share of the largest one (Tolerance)
    # each tensor read (and compared) piece by piece where it is in a file store: at most two pieces held at once
    has_grad, got_grad = _with_grad(reference.grads), set(_with_grad(result.grads))
    floor = tol.grad_floor * max((tensor_norm(reference.grads, name) for name in has_grad), default=0.0)
    for name in has_grad:
        if name not in got_grad:
            missing += 1
            continue
        worst, diff_norm, ref_norm = difference_norms(result.grads, reference.grads, name)
        max_abs = _worst(max_abs, worst)
        max_rel = _worst(max_rel, diff_norm / max(ref_norm, floor, 1e-12))
    bn_match = True
    for name, ref in reference.buffers.items():
        got = result.buffers[name]
        if ref.dtype in (torch.int64, torch.int32):
            bn_match &= bool(torch.equal(got, ref))  # num_batches_tracked: a second update shows here
        else:
            # a strategy may keep its buffers in another dtype (bf16_weights)
            bn_match &= bool(torch.allclose(got.to(ref.dtype), ref, rtol=tol.grad_rtol, atol=tol.output_atol))
    output_rel_diff = _output_rel_diff(result.outputs, reference.outputs, tol.output_atol)
    output_match = output_rel_diff <= tol.output_rtol
    param_rel = functools.reduce(_worst, (diff / max(ref, 1e-12) for diff, ref in
                                          (difference_norms(result.stepped, reference.stepped, name)[1:]
                                           for name in reference.stepped if name in result.stepped)), 0.0)
    matches = (loss_rel_diff <= tol.loss_rtol and max_rel <= tol.grad_rtol and missing == 0 and bn_match
               and param_rel <= tol.step_rtol and (output_match or bool(reference.grads)))
    failed = _failed_checks(tol, loss_rel_diff, max_rel, missing, bn_match, param_rel, output_rel_diff,
                            reference)
    columns = {
        "matches_baseline": bool(matches),
        "loss_rel_diff": loss_rel_diff,
        "max_abs_grad_diff": max_abs if reference.grads else None,
        "max_grad_rel_diff": max_rel if reference.grads else None,
        "params_without_grad": missing,
        "bn_stats_match": bool(bn_match),
        "output_rel_diff": output_rel_diff,
        "max_param_rel_diff": param_rel if reference.stepped else None,
    }
    if failed:
        columns["message"] = "differs from the baseline: " + "; ".join(failed)
    return columns


def _with_grad(grads: Mapping[str, torch.Tensor | None]) -> list[str]:
    """The names of a snapshot's gradients that exist (without reading a stored one)."""
    return grads.present() if isinstance(grads, StoredTensors) else [n for n, g in grads.items() if g is not None]


def _noise_text(noise: DeviceNoise) -> str:
    return ", ".join(f"{name} {value:.2g}" for name, value in
                     (("loss", noise.loss), ("gradient", noise.grad), ("output", noise.output), ("step", noise.step))
                     if value)


def _failed_checks(tol, loss_rel_diff: float, grad_rel: float, missing: int, bn_match: bool, param_rel: float,
                   output_rel_diff: float, reference: Snapshot) -> list[str]:
    """Each check of `compare` that failed, as `what: measured > tolerance name and value` (a NaN fails too)."""
    failed = []

    def over(what: str, value: float, name: str) -> None:
        limit = getattr(tol, name)
        if not value <= limit:
            failed.append(f"{what} rel diff {value:.3g} > {name} {limit:g}")

    over("loss", loss_rel_diff, "loss_rtol")
    if reference.grads:
        over("gradient", grad_rel, "grad_rtol")
    else:  # in training the outputs are judged through the loss and gradients (see compare)
        over("output", output_rel_diff, "output_rtol")
    if reference.stepped:
        over("weights after one step", param_rel, "step_rtol")
    if missing:
        failed.append(f"{missing} parameter(s) got no gradient where the baseline's did")
    if not bn_match:
        failed.append(f"buffers differ: BatchNorm statistics or other buffers such as rotary tables (rtol grad_rtol "
                      f"{tol.grad_rtol:g}, atol output_atol {tol.output_atol:g}; or a second update of "
                      "num_batches_tracked)")
    return failed


def _worst(a: float, b: float) -> float:
    """The larger difference, NaN if either is (Python's max would drop a NaN, and a NaN gradient would match)."""
    return a + b if math.isnan(a) or math.isnan(b) else max(a, b)


def _output_rel_diff(outputs: list[torch.Tensor], references: list[torch.Tensor], atol: float) -> float:
    """The largest |out - ref| / |ref| (norms) over the output tensors; 0 for one within `atol` element by
    element; infinite when the outputs differ in number or shape."""
    if len(outputs) != len(references) or _shapes(outputs) != _shapes(references):
        return float("inf")
    worst = 0.0
    for index in range(len(outputs)):
        close, diff_sq, ref_sq = True, 0.0, 0.0
        # piece by piece where both are stored in files: a language model's logits (gpt2 at batch 2: 49 MiB) were
        # read whole, twice, with allclose's and the difference's temporaries beside them
        for got, ref in _output_pieces(outputs, references, index):
            close &= bool(torch.allclose(got, ref, rtol=0, atol=atol))
            diff_sq += float(torch.linalg.vector_norm(got - ref)) ** 2
            ref_sq += float(torch.linalg.vector_norm(ref)) ** 2
        if not close:
            worst = _worst(worst, diff_sq ** 0.5 / max(ref_sq ** 0.5, 1e-12))
    return worst


def _output_pieces(outputs: Sequence[torch.Tensor], references: Sequence[torch.Tensor], index: int):
    """The `index`-th output of both, as pairs of float32 pieces read from their file stores, or whole."""
    if isinstance(outputs, StoredList) and isinstance(references, StoredList) \
            and isinstance(outputs.store, FileStore) and isinstance(references.store, FileStore):
        return zip(outputs.store.chunks((outputs.group, index), tensor_store.CHUNK_ELEMENTS),
                   references.store.chunks((references.group, index), tensor_store.CHUNK_ELEMENTS))
    return [(outputs[index], references[index])]


def _shapes(tensors: Sequence[torch.Tensor]) -> list[torch.Size]:
    """The shapes of a snapshot's outputs, without reading a stored one."""
    return tensors.shapes() if isinstance(tensors, StoredList) else [t.shape for t in tensors]


def _is_fake(result: Snapshot) -> bool:
    """Whether the snapshot was taken on fake tensors (kept in memory: a file store holds real values only)."""
    if result.store is not None and not isinstance(result.store, MemoryStore):
        return False
    values = (*result.outputs, *result.buffers.values(), *result.grads.values())
    return any(is_fake(t) for t in values if t is not None)


def verify(case: Case, strategy: Strategy) -> dict[str, Any]:
    """The verification columns of the row, and in `message` which check failed, by how much and against which
    tolerance, and why the strategy cannot match, if it cannot; on fake tensors (the fake-CUDA run) nothing is
    compared, since they have no values: `matches_baseline` is empty.

    A loss that is not finite raises NonFiniteLoss (the case's row is an `error`); where only the baseline's is not
    finite there is nothing to compare with: `matches_baseline` is empty and `message` says why."""
    progress.report("verification", 0, 1)
    result = snapshot(case, strategy)
    if _is_fake(result):
        return {"matches_baseline": None, "message": "not verified: the step ran on fake tensors, which have no values"}
    reference = baseline_snapshot(case)
    where = "at step 1 (verification, from the seeded start)"
    if not math.isfinite(result.loss):
        raise non_finite_loss(result.loss, where, None if strategy.spec() == "baseline" else reference.loss)
    if not math.isfinite(reference.loss):
        return {"matches_baseline": None,
                "message": f"not verified: the baseline's loss is not finite ({reference.loss}) {where}"}
    columns = compare(result, reference, strategy)
    # the device's own noise is measured (a second baseline run, on CUDA) only for a result the exact tolerance refuses
    noise = DeviceNoise() if columns["matches_baseline"] else device_noise(case)
    if noise != DeviceNoise():
        columns = compare(result, reference, strategy, noise)
        if columns["matches_baseline"]:
            columns["message"] = (f"matches within {DEVICE_NOISE_MULTIPLE:g}x the baseline's own run-to-run "
                                  f"difference on this device ({_noise_text(noise)}), not within the exact "
                                  f"tolerance: its kernels are not deterministic")
    reason = strategy.differs_by_design()
    if reason and columns["matches_baseline"]:  # e.g. a step that differs only from the second on
        columns["message"] = f"matches the baseline in the verified step, though it differs by design: {reason}"
    elif reason:
        measured = columns.pop("message", "").replace("differs from the baseline: ", "")
        columns["message"] = f"does not match the baseline by design: {reason}" + (f" ({measured})" if measured else "")
    return columns
