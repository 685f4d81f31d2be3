"""Mixture-of-experts decoders in the `hf:` workload: how their tokens reach the experts in a step, on real tensors
and on fake ones, and the router's and the experts' memory filed apart in the breakdown.

transformers 5 keeps each MoE layer's experts as two 3-D parameters (`gate_up_proj`, experts x 2*intermediate x
hidden, and `down_proj`) and runs them through an `experts_implementation` (`integrations/moe.py`, chosen by the
`@use_experts_implementation` decorator of the experts' class). Its default, and what a training script gets unless
it asks for another, is `grouped_mm`: the (token, chosen expert) pairs are sorted by expert, the hidden states
gathered in that order (tokens x experts-per-token rows), and each projection is one `torch._grouped_mm` over all
experts with the per-expert row counts as offsets (`torch.histc` of the expert ids); the results are put back in
token order and summed over the chosen experts. Every buffer of that path has tokens x experts-per-token rows (or
one row per expert) whatever the router chose: its memory does not depend on the routing, so a prediction on fake
tensors, which cannot know the routing, needs no assumption about it (balanced or not, the same bytes). The
workload leaves transformers' choice as it is (the models it builds say `grouped_mm`: tests/test_moe.py); the eager
loop (`"eager"`: one matrix product per expert hit, sized by the tokens it got, found with `nonzero`) is
data-dependent, and a prediction's message says so where a model runs it (`routing_note`).

On meta and fake tensors one piece is missing from PyTorch: the meta kernel of `aten._grouped_mm` accepts bfloat16
only (`_meta_grouped_mm_common` copies the check of CUDA's fast CUTLASS path), while the operator itself runs any
float dtype, on the CPU (its own kernel) and on CUDA (float32, or any GPU but sm90/sm100: `_grouped_mm_fallback`,
one matrix product per group into the same output tensor). `register_grouped_mm_meta_kernel` makes the operator's
Meta kernel return, for the dtypes torch's refuses, the output those kernels return (`_create_grouped_mm_output_tensor`,
the one torch's meta kernel makes); bfloat16 calls keep torch's own meta kernel and its checks. Registered once per
process, when an MoE workload is configured; it changes nothing that torch's meta kernel answers.

The breakdown: `file_moe_allocations` makes each router's and each experts module's forward declare its storages
(`bench.core.memory_categories.allocating`): the router's logits, probabilities and top-k choices as `MOE_ROUTER`,
the experts' dispatch buffers (the sorted copies of the hidden states, the grouped products, the gathered results)
as `MOE_DISPATCH`. Both are activations in every breakdown column (`bench.measure.breakdown`); the parts are named in
a prediction's message. The experts' and router's weights are counted from the model (`parameter_split`).
"""

from __future__ import annotations

import torch
from torch import nn

from bench.core.memory_categories import MOE_DISPATCH, MOE_ROUTER, allocating

EXPERTS_IMPLEMENTATION = "grouped_mm"  # transformers 5's default experts_implementation, and what membench runs
# the experts implementations whose buffers have the same sizes whatever the routing (batched_mm: one product per
# (token, expert) pair, with each pair's weights gathered)
ROUTING_FREE_IMPLEMENTATIONS = (EXPERTS_IMPLEMENTATION, "batched_mm")
# the configuration attributes that say a model routes tokens to experts (transformers' names, per model type)
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def expert_count(config) -> int:
    """The experts per MoE layer that `config` declares (0: a dense model)."""
    for key in EXPERT_COUNT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def is_moe(config) -> bool:
    """Whether `config` (a transformers configuration) describes a mixture-of-experts model."""
    return expert_count(config) > 0 and isinstance(getattr(config, "num_experts_per_tok", None), int)


def is_experts_module(module: nn.Module) -> bool:
    """Whether `module` is an experts class under transformers' `@use_experts_implementation` (its instances carry
    the decorator's attributes)."""
    return hasattr(module, "_is_expert_parallel") and hasattr(module, "has_gate")


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module | None]]:
    """(name, experts, router) of each MoE layer of `model`: the experts module, and its sibling `gate` (the router
    of Mixtral, Qwen3-MoE, OLMoE and their kin), None where the block has none."""
    blocks = []
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if isinstance(experts, nn.Module) and is_experts_module(experts):
            router = getattr(module, "gate", None)
            blocks.append((name, experts, router if isinstance(router, nn.Module) else None))
    return blocks


def _file_forward(module: nn.Module, category: str) -> None:
    """Hooks on `module` that file what its forward allocates under `category`: entered before it, left after it,
    also when it raises (`always_call`). Hooks, not a wrapped `forward`: a copy of the module keeps calling its own."""
    if getattr(module, "_membench_moe_category", None) == category:
        return
    entered: list = []  # the open `allocating` contexts, innermost last (a checkpoint's recompute nests none)

    def enter(module, args):
        context = allocating(category)
        context.__enter__()
        entered.append(context)

    def leave(module, args, output):
        if entered:
            entered.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
    module._membench_moe_category = category


def file_moe_allocations(model: nn.Module) -> nn.Module:
    """`model`, with each router's forward filing what it allocates under `MOE_ROUTER` and each experts module's
    under `MOE_DISPATCH` (no tracker listening: nothing is filed, nothing else changes)."""
    for _, experts, router in moe_blocks(model):
        _file_forward(experts, MOE_DISPATCH)
        if router is not None:
            _file_forward(router, MOE_ROUTER)
    return model


def parameter_split(model: nn.Module) -> dict[str, int]:
    """The parameters of `model` (built on any device, the meta device included): `experts` (every expert's
    weights), `router` (the routers'), `total`."""
    experts = router = 0
    for _, expert_module, router_module in moe_blocks(model):
        experts += sum(p.numel() for p in expert_module.parameters())
        if router_module is not None:
            router += sum(p.numel() for p in router_module.parameters())
    return {"experts": experts, "router": router, "total": sum(p.numel() for p in model.parameters())}


def routing_note(config, model: nn.Module) -> str:
    """What a prediction of an MoE model (`model`: the one it runs, built on any device) says about its experts: how
    tokens reach them, and their share of the weights."""
    split = parameter_split(model)
    implementation = getattr(model.config, "_experts_implementation", None)
    shape = f"MoE: {expert_count(config)} experts per layer, {config.num_experts_per_tok} per token"
    if not moe_blocks(model) or implementation not in ROUTING_FREE_IMPLEMENTATIONS:
        # the eager loop, or an MoE without transformers' grouped experts (remote code): sized by the routing
        return (f"{shape}, run by {implementation or 'its own code'}, whose buffers are sized by the routing: fake "
                "tensors cannot run it (a prediction falls back to a real step)")
    return (f"{shape}, run by transformers' {implementation} (tokens sorted by expert, one grouped product per "
            "projection): its buffers have tokens x experts-per-token rows whatever the routing, so no routing is "
            f"assumed; experts' weights {split['experts']:,} of {split['total']:,} parameters "
            f"({100 * split['experts'] / (split['total'] or 1):.1f}%), router {split['router']:,}")


# --- aten._grouped_mm on meta and fake tensors -----------------------------------------------------------------

_META_KERNELS: list[torch.library.Library] = []  # kept alive: a Library's registrations die with it


def _grouped_mm_meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """`aten._grouped_mm` on meta tensors (fake tensors run it too): bfloat16 through torch's own meta kernel and its
    checks; any other float dtype the output tensor the CPU kernel and CUDA's fallback return (see the module)."""
    from torch._meta_registrations import _create_grouped_mm_output_tensor, meta_grouped_mm

    if mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16:
        return meta_grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
    torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3),
                 lambda: f"grouped_mm: operands must be 2-D or 3-D, got {mat_a.dim()} and {mat_b.dim()}")
    torch._check(mat_a.dtype == mat_b.dtype and mat_a.dtype.is_floating_point,
                 lambda: f"grouped_mm: operands of one float dtype expected, got {mat_a.dtype} and {mat_b.dtype}")
    return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)


def register_grouped_mm_meta_kernel() -> None:
    """Gives meta and fake tensors `aten._grouped_mm` in every float dtype its kernels run (see the module): the
    operator's Meta kernel replaced by `_grouped_mm_meta`, once per process."""
    if _META_KERNELS:
        return
    library = torch.library.Library("aten", "IMPL")
    library.impl("_grouped_mm", _grouped_mm_meta, "Meta")
    _META_KERNELS.append(library)
