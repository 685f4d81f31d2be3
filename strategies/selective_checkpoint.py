"""Selective activation checkpointing: per operator, save the outputs of expensive ops and recompute the cheap ones.

Each of the workload's checkpoint units runs under `torch.utils.checkpoint.checkpoint` with the contexts of
`create_selective_checkpoint_contexts(policy)`: the policy sees every operator of the unit's forward and says
whether its output is kept (MUST_SAVE) or recomputed in backward (PREFER_RECOMPUTE). Plain checkpointing keeps
only each unit's input and recomputes everything; saving the matmuls' and convolutions' outputs makes the
recompute nearly free (normalisation, activations, element-wise ops) and saves less memory.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from bench.core.errors import Unsupported, choices_error
from strategies import Strategy, register_strategy
from strategies.checkpoint import UnitCheckpointer

aten = torch.ops.aten

MATMUL_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.matmul.default,
              aten.linear.default}
ATTENTION_OPS = {getattr(aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_attention_math") if hasattr(aten, name)}
CONVOLUTION_OPS = {aten.convolution.default, aten.cudnn_convolution.default, aten.mkldnn_convolution.default}
CONVOLUTION_OPS = {op for op in CONVOLUTION_OPS if op is not None}

# policy name -> the operators whose outputs are saved (everything else is recomputed in backward)
POLICIES = {
    "compute": MATMUL_OPS | ATTENTION_OPS | CONVOLUTION_OPS,  # save the expensive ops, recompute the cheap ones
    "matmul": MATMUL_OPS | ATTENTION_OPS,  # save matmuls and attention only: convolutions are recomputed too
    "none": set(),  # save nothing: plain checkpointing of each unit, through the selective machinery
    "every_other_mm": ATTENTION_OPS,  # and every other aten.mm of each unit (every_other_mm_policy)
}
# torchtitan's per-op policy (activation_checkpoint.selective_ac_option = "op"; its llama3 parallelize.py,
# _op_sac_save_list, at commit 238fa9953e4aec2a62582121564273d7cbb1e9f1): beside attention it saves the outputs of
# reduce-scatters (sequence parallelism's) and of max (float8's scales), and of the 1st, 3rd, ... aten.mm of each unit
# (in a Llama layer q, v, gate and down projections; k, o and up are recomputed)
EVERY_OTHER_MM_EXTRA = {aten.max.default} | ({torch.ops._c10d_functional.reduce_scatter_tensor.default}
                                           if hasattr(torch.ops, "_c10d_functional") else set())


def policy_fn(saved_ops: set):
    """The policy function of `create_selective_checkpoint_contexts` that saves the outputs of `saved_ops`."""
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved_ops else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def every_other_mm_policy():
    """A fresh policy for one checkpoint (one unit's forward and its recompute), as torchtitan makes one per call:
    it saves attention's, reduce-scatter's and max's outputs and those of the odd-numbered aten.mm calls of the unit,
    counted apart in the forward and in the recompute so that both make the same choice."""
    counts = {False: 0, True: 0}  # aten.mm calls so far, in the forward (False) and in the recompute (True)
    saved = POLICIES["every_other_mm"] | EVERY_OTHER_MM_EXTRA

    def policy(ctx, op, *args, **kwargs):
        if op is aten.mm.default:
            counts[ctx.is_recompute] += 1
            keep = counts[ctx.is_recompute] % 2 == 1
        else:
            keep = op in saved
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


@register_strategy
class SelectiveCheckpoint(Strategy):
    """Every checkpoint unit checkpointed on its own, with a selective policy (option `policy`):

    - `compute` (default): save the outputs of matmul, convolution and attention; recompute normalisation,
      activations and element-wise ops. The backward's recompute then costs almost nothing, and what is saved is
      what those cheap ops would otherwise keep (BatchNorm's and ReLU's own saved tensors, GELU's input, ...);
    - `matmul`: save only matmul and attention outputs; convolutions are recomputed (on a CNN close to plain
      checkpointing, on a transformer the same as `compute`);
    - `none`: save nothing, recompute each unit whole (plain checkpointing with every unit its own segment);
    - `every_other_mm`: torchtitan's per-operator policy (`selective_ac_option = "op"`): save attention's output and
      that of every other matmul (aten.mm) of the unit, the 1st, 3rd, ...; recompute the rest.

    The trap: the captcha ResNet's residual add is in place (`tmp += self.identity(x)`) on the output of its
    second BatchNorm. PyTorch raises "Tensor cached during selective activation checkpoint has been mutated" when
    an op mutates a saved output; the outputs saved here are the convolutions', never mutated in place, and the
    BatchNorm output the add mutates is recomputed, so it runs (a test pins it). A policy that saved that
    BatchNorm's output would fail that way; such a failure in a sweep is an `error` row, and the sweep goes on.
    BatchNorm statistics are restored after each recompute, as in `checkpoint`. Exact: the same fp32 arithmetic.

    Limitations: it needs the workload's checkpoint units (a model naming none is an `unsupported` row),
    and each is its own checkpoint (no segments). The policies know the operators listed in this module (matmul,
    attention, convolution): any other operator's output is recomputed, however expensive. An output the policy saves
    that a later operation mutates in place raises in PyTorch, and the row is an `error`. Train only.
    """

    name = "selective_checkpoint"
    keeps_training_state = True
    recompute_plan_kind = "operators"
    description = "selective activation checkpointing of each checkpoint unit: save matmul/conv/attention outputs, recompute the rest"
    options = {"policy": "compute"}
    phases = ("train",)
    priority = 30
    conflicts = ("checkpoint",)

    # save the expensive operators' outputs (compute), or matmuls only (convolutions recomputed too)
    plan_options = ({"policy": "compute"}, {"policy": "matmul"})
    # Its memory effect is pinned in tests/test_activation_memory.py on gpt_mini
    memory_effect = {}  # no band on captcha_resnet18: see above

    def __init__(self, **options):
        super().__init__(**options)
        if self.settings["policy"] not in POLICIES:
            raise choices_error("selective_checkpoint policy", self.settings["policy"], list(POLICIES))
        self._policy = policy_fn(POLICIES[self.settings["policy"]])

    def _context_fn(self):
        """Each checkpoint's `context_fn`: its policy's (forward, recompute) contexts. A plain function, not a method:
        torch.compile, tracing through checkpoint, calls a method's function without its object."""
        policy, fresh = self._policy, self.settings["policy"] == "every_other_mm"

        def contexts():
            # every_other_mm counts its calls: a fresh one for each checkpoint
            return create_selective_checkpoint_contexts(every_other_mm_policy() if fresh else policy)
        return contexts

    def prepare_model(self, model, units):
        if not units:
            owner = self.model_owner()
            raise Unsupported(f"selective_checkpoint needs checkpoint units; {owner} names none")
        checkpointer = UnitCheckpointer(model, context_fn=self._context_fn())
        for unit in units:
            checkpointer.install([unit])
        return model

    def recompute_plan(self):
        return f"each unit, saving {self.settings['policy']}"

    def recomputed_groups(self):
        return []  # each unit is its own checkpoint; the policy decides what within it is recomputed
