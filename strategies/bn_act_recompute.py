"""BatchNorm -> activation recomputed in backward from BatchNorm's input (the efficient-DenseNet approach)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

from bench.core.errors import Unsupported
from strategies import MATCHES, Strategy, register_strategy, unsupported
from strategies.framework.bn_act_pairs import (
    FusedPairs, Pair, find_pairs, pair_summary, require_batchnorm, require_pairs,
)
from strategies.checkpoint import preserved


class _Recipe:
    """What a saved pair output is rebuilt from in backward: BatchNorm's input and the pair's function."""

    __slots__ = ("source", "source_version", "run")

    def __init__(self, source: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor]):
        self.source, self.source_version, self.run = source, source._version, run

    def rebuild(self) -> torch.Tensor:
        if self.source._version != self.source_version:
            raise RuntimeError("bn_act_recompute: a BatchNorm input was modified in place after the forward; its "
                               "activation cannot be recomputed from it")
        with torch.no_grad():
            return self.run(self.source)


class RecomputedPairs(FusedPairs):
    """Each pair runs as one non-reentrant checkpoint of BatchNorm + activation (BatchNorm statistics restored in
    the recompute, as `checkpoint` does), and its output, wherever a later operation saves it for backward (the
    next convolution, a max-pool, the next block's shortcut), is saved as a recipe instead: the output is dropped
    after the forward and rebuilt from BatchNorm's input when backward needs it."""

    def __init__(self, pairs: list[Pair]):
        self.recipes: dict[int, tuple[weakref.ref, int, _Recipe]] = {}  # id(output) -> (output, version, recipe)
        super().__init__(pairs, self._forward)

    def _forward(self, pair: Pair, bn_forward, activation, x):
        def run(source):
            return activation(bn_forward(source))

        if not (pair.bn.training and torch.is_grad_enabled()):
            return run(x)
        buffers = list(pair.bn.buffers())

        def restoring_run(source):
            with preserved(buffers):  # a recompute must not update the running statistics a second time
                return run(source)

        out = checkpoint(run, x, use_reentrant=False, preserve_rng_state=False,
                         context_fn=lambda: (contextlib.nullcontext(), preserved(buffers)))
        self.recipes[id(out)] = (weakref.ref(out), out._version, _Recipe(x, restoring_run))
        return out

    def pack(self, tensor: torch.Tensor) -> Any:
        entry = self.recipes.get(id(tensor))
        if entry is not None and entry[0]() is tensor and tensor._version == entry[1]:
            return entry[2]
        return tensor

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.rebuild() if isinstance(packed, _Recipe) else packed

    @contextlib.contextmanager
    def active(self):
        """Around one forward: outputs of pairs saved by later operations are saved as recipes."""
        self.recipes.clear()
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack))
            mode = self.skipping()
            if mode is not None:
                stack.enter_context(mode)
            try:
                yield
            finally:
                self.recipes.clear()  # the outputs' ids may be reused by later tensors


@register_strategy
class BNActRecompute(Strategy):
    """Every BatchNorm -> activation pair recomputed in backward from BatchNorm's input, so that of a
    conv -> BN -> act -> conv chain only the convolution's output is kept (efficient DenseNet, Pleiss et al. 2017;
    the memory-saving article).

    In the baseline a pair keeps two activation-sized tensors for backward: BatchNorm's input (the convolution's
    output, which BatchNorm's backward needs) and the activation's output (which ReLU's backward and the next
    convolution's weight gradient need). Here only the first is kept: the pair runs as a checkpoint from
    BatchNorm's input, and wherever a later operation saves the pair's output, a saved-tensor hook saves a recipe
    instead (`RecomputedPairs`), so the output is freed after the forward and rebuilt by each backward operation
    that needs it. The running statistics are updated once per step, by the forward: every recompute restores them
    (`strategies.checkpoint.preserved`). Exact: the recompute repeats the same arithmetic on the same input.

    Pairs are found by tracing the model with torch.fx (`strategies.framework.bn_act_pairs`): a BatchNorm whose only
    consumer is an activation, module or function. The row's settings say how many. Train only: without a backward
    nothing is recomputed.

    Limitations: a model torch.fx cannot trace, or without a BatchNorm feeding an activation (GPT-style
    transformers, MLPs, BatchNorm followed by a residual add), is an `unsupported` row that says so. Each backward
    operation that reads a pair's output recomputes it (a ReLU output read by the next conv and by the ReLU's own
    backward is recomputed twice): memory is bought with ~1-3 BatchNorm+activation forwards per pair per step.
    """

    name = "bn_act_recompute"
    keeps_training_state = True
    description = "every BatchNorm->activation pair recomputed in backward from BatchNorm's input (efficient DenseNet)"
    phases = ("train",)
    priority = 25  # after in-place ReLU changed the model, before checkpoint wraps its units
    # the saved-tensor hooks and the torch-function mode are not traced by dynamo; under checkpointing the recompute
    # finds the pair's saved tensors changed (CheckpointError: "Recomputed values ... have different metadata")
    conflicts = ("compile", "checkpoint", "selective_checkpoint")
    # Train 221,420,444 -> 210,406,812 (0.950) on captcha_resnet18: each BN->ReLU output is recomputed, not kept
    # (9 pairs).
    memory_effect = {"train": (0.93, 0.97)}
    expected = unsupported("has no BatchNorm layer")  # LayerNorm, RMSNorm, none
    # where a BatchNorm feeds an activation, as in every BatchNorm model here (one whose BatchNorms all feed a
    # residual add has no pair: unsupported)
    expected_with = {"batch_norm": MATCHES}
    refusals = (r"has no BatchNorm layer, so no BatchNorm->activation pair",)

    def __init__(self, **options):
        super().__init__(**options)
        self.fused: RecomputedPairs | None = None
        self.summary: str | None = None

    def check(self, context):
        require_batchnorm(self.name, context.workload)
        super().check(context)

    def prepare_model(self, model, units):
        pairs, batchnorms = find_pairs(model, f"{self.name}: {self.model_owner()}")
        require_pairs(pairs, batchnorms, self.model_owner(), self.name)
        self.summary = pair_summary(pairs, batchnorms)
        self.fused = RecomputedPairs(pairs)
        return model

    def forward(self):
        if self.fused is None:
            raise Unsupported(f"{self.name}: forward before prepare_model")
        return self.fused.active()

    def describe(self):
        return {f"{self.name}.pairs": self.summary} if self.summary else {}
