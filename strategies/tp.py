"""Tensor parallelism (Megatron-style, `torch.distributed.tensor.parallel`) with sequence parallelism and loss
parallelism, as torchtitan applies it to Llama; with `fsdp`, on a 2-D data-parallel x tensor-parallel mesh.

`tp:degree=T` splits every decoder layer of a Llama-layout model (transformers' Llama family: `q_proj`, `k_proj`,
`v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`, `input_layernorm`, `post_attention_layernorm`, the final
`norm`, `embed_tokens` and `lm_head`) over T ranks: ColwiseParallel on the q/k/v and gate/up projections (each rank
computes 1/T of the heads and of the MLP's hidden width), RowwiseParallel on o/down (their partial sums reduced),
RowwiseParallel on the token embedding (its vocabulary rows split) and ColwiseParallel on the LM head (its vocabulary
columns split). `sequence_parallel=true` (torchtitan's default) keeps the residual stream, and the norms that run on
it (SequenceParallel), split along the sequence between the layers: o/down reduce-scatter their outputs along the
sequence, and each attention and MLP block all-gathers its normed input (PrepareModuleInput). `loss_parallel=true`
(torchtitan's default) leaves the logits split along the vocabulary and computes the cross-entropy on the shards
(`torch.distributed.tensor.parallel.loss_parallel`), so no rank holds the whole logits.

The ranks form a dp x tp mesh (`dp = --ranks / degree`, the T ranks of a tensor-parallel group consecutive, as
torchrun places them inside a node); the batch is split over the dp dimension only (the ranks of a tensor-parallel
group train on the same samples). `fsdp+tp:degree=T` shards every parameter over the dp dimension as well
(`fully_shard` on the dp sub-mesh, torchtitan's FSDP x TP); `tp` alone needs `--ranks` equal to its degree (nothing
would average the gradients of several data-parallel replicas).

The collectives' buffers are filed as communication in the breakdown (`bench.core.memory_categories`): what
DTensor's redistributions allocate (the functional collectives' outputs: the all-gathers of the sequence-parallel
inputs before they are rearranged, the reduce-scatters' and all-reduces' results) for as long as they live.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.core.errors import Unsupported, UsageError
from bench.core.memory_categories import COMMUNICATION, allocating
from strategies import register_strategy
from strategies.framework.sharding import Sharded, check_divides_ranks, rank_and_world

# the module names torchtitan's Llama plan is written for, in transformers' spelling
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")


def _collective_ops() -> frozenset:
    """The functional collectives DTensor's redistributions call (`torch.ops._c10d_functional`), whose outputs are
    the collectives' buffers."""
    ops = torch.ops._c10d_functional
    return frozenset(getattr(ops, name).default for name in (
        "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single")
        if hasattr(ops, name))


class _CollectivesAsCommunication(TorchDispatchMode):
    """Files what a functional collective allocates as communication (the tracker, a dispatch mode entered before
    this one, sees the operator inside `allocating(COMMUNICATION)`)."""

    def __init__(self):
        super().__init__()
        self.collectives = _collective_ops()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.collectives:
            with allocating(COMMUNICATION):
                return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _forget_other_ranks_meshes(device: str) -> None:
    """Empties DTensor's caches of sharding decisions, which hold the meshes they were made on: a prediction is each
    rank in turn in one process (bench.run.ranks.fake_process_group), and the next rank's mesh is equal to the
    previous one's (the same table: DeviceMesh's equality ignores the rank) while its process groups are new; a
    cached decision would hand the next rank the previous rank's mesh, whose groups it cannot resolve ("Could not
    resolve the process group"). The caches are per thread: on CUDA the backward runs in autograd's device thread,
    whose caches a backward through `_CachesEmptiedInBackward` empties."""
    _empty_sharding_caches()
    if device == "cuda":
        start = torch.zeros((), device=device, requires_grad=True)
        _CachesEmptiedInBackward.apply(start).backward()


def _empty_sharding_caches() -> None:
    """This thread's caches of DTensor's sharding decisions (Python's and the C++ fast path's) and of its
    redistribution plans."""
    from torch.distributed.tensor import _collective_utils, _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()


class _CachesEmptiedInBackward(torch.autograd.Function):
    """The identity, whose backward empties the sharding caches of the thread it runs in."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad):
        _empty_sharding_caches()
        return grad


def _llama_layers(model) -> tuple[torch.nn.Module, list[torch.nn.Module]] | None:
    """(the base model holding `embed_tokens`, `layers` and `norm`, its decoder layers) of a Llama-layout model;
    None for any other."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if base is None or layers is None or not hasattr(base, "embed_tokens") or not hasattr(base, "norm"):
        return None
    for layer in layers:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attention is None or mlp is None or not all(hasattr(attention, n) for n in ATTENTION_PROJECTIONS) \
                or not all(hasattr(mlp, n) for n in MLP_PROJECTIONS) or not all(hasattr(layer, n) for n in LAYER_NORMS):
            return None
    return base, list(layers)


def tensor_parallel_refusal(model, degree: int) -> str | None:
    """Why torchtitan's Llama plan cannot split `model` over `degree` ranks (None where it can): a model without
    the Llama layout, or head counts, hidden widths or a vocabulary the degree does not divide."""
    found = _llama_layers(model)
    if found is None:
        return (f"tp needs a Llama-layout model (transformers' q/k/v/o_proj, gate/up/down_proj, input_layernorm, "
                f"post_attention_layernorm, embed_tokens, norm, lm_head); {type(model).__name__} is not one")
    config = getattr(model, "config", None)
    sizes = {"num_attention_heads": getattr(config, "num_attention_heads", None),
             "num_key_value_heads": getattr(config, "num_key_value_heads", None),
             "intermediate_size": getattr(config, "intermediate_size", None),
             "vocab_size": getattr(config, "vocab_size", None)}
    for key, size in sizes.items():
        if size is not None and size % degree:
            return f"tp:degree={degree} does not divide the model's {key} ({size}): each rank must hold whole ones"
    if not isinstance(getattr(model, "lm_head", None), torch.nn.Linear):
        return f"tp needs a causal language model with an lm_head; {type(model).__name__} has none"
    return None


def tensor_parallel_degrees(workload) -> list[int]:
    """The tp degrees (2 or more) that split a transformers workload's model evenly, from its configuration
    (`workload.config()`, no model built): each divides the attention and key/value heads, the MLP width, the
    vocabulary and the sequence length (sequence parallelism's split). Empty for a workload without such a
    configuration, or with a tied embedding and LM head (which tp refuses)."""
    config = workload.config() if callable(getattr(workload, "config", None)) else None
    heads = getattr(config, "num_attention_heads", None)
    if not heads or getattr(config, "tie_word_embeddings", False):
        return []
    sizes = [heads, getattr(config, "num_key_value_heads", None) or heads, getattr(config, "intermediate_size", None),
             getattr(config, "vocab_size", None), getattr(workload, "settings", {}).get("seq_len")]
    return [degree for degree in range(2, heads + 1) if all(size is None or size % degree == 0 for size in sizes)]


@register_strategy
class TensorParallel(Sharded):
    """`torch.distributed.tensor.parallel.parallelize_module` with torchtitan's Llama plan over `degree` ranks
    (module docstring): each rank holds 1/degree of every projection, of the embedding and of the LM head (the
    norms replicated), the activations inside attention and MLP for 1/degree of the heads, and, with
    `sequence_parallel`, the residual stream for 1/degree of the sequence. Options: `degree`, `sequence_parallel`
    (default true), `loss_parallel` (default true). Composes with fsdp (`fsdp+tp:degree=2`: FSDP2 over the
    data-parallel dimension of the 2-D mesh) and checkpoint. Exact up to float summation order.

    Limitations: it needs a Llama-layout transformers model (`hf:tiny-llama`, `hf:llama-3.2-1b`...): any other
    model, or a degree that does not divide its attention heads, key/value heads, MLP width or vocabulary, is an
    `unsupported` row naming why. `--ranks` must be a multiple of `degree`, and equal to it unless composed with
    fsdp. Unlike torchtitan, the token embedding's output is all-reduced and then split along the sequence (not
    reduce-scattered): transformers' Llama derives the rotary positions from the embedding's sequence length, which
    must be the whole sequence (one [batch, seq, hidden] buffer more, per rank, for the embedding's output).
    `fsdp:replicate` (HSDP) with tp is not supported, and neither is a tied embedding and LM head (Llama 3.2's):
    tying is undone by the split, so such a model is refused. Loss parallelism replaces the backward, so tp does
    not compose with amp's GradScaler (nor with tp's own backward's other owners). With sequence parallelism the
    degree must divide the sequence length (an uneven split fails in transformers' Llama: the row is `unsupported`).
    Each functional collective's output is filed as communication for as
    long as it lives, even where it is used on as an activation (the all-reduce of RowwiseParallel without
    sequence parallelism, the gathered logits without loss parallelism). What DTensor runs inside its own dispatch
    of an operator (loss parallelism's reductions inside the cross-entropy, a redistribution its sharding
    propagation decides inside an operator) is seen by no dispatch mode, so by no live-tensor tracker: those
    transient buffers are in neither the CPU measurement nor the prediction (their equality to the byte holds
    without them), where a GPU's `max_memory_allocated` would count them."""

    name = "tp"
    description = "tensor parallelism (colwise/rowwise projections, sequence and loss parallel) over a dp x tp mesh"
    priority = 65  # parallelizes the model before fsdp (70) shards its DTensors over the mesh's dp dimension
    options = {"degree": 2, "sequence_parallel": True, "loss_parallel": True}
    shards_with = ("fsdp",)  # fsdp+tp: one dp x tp mesh; the batch split is tp's (`data_parallel_place`)
    refusals = (*Sharded.refusals, r"tp:degree=\d+ does not divide --ranks", r"tp needs a Llama-layout model",
                r"tp:degree=\d+ does not divide the model's", r"tp:degree=\d+ on --ranks \d+ leaves",
                r"tp needs a causal language model", r"tp does not split a tied",
                r"tp:degree=\d+ with sequence_parallel needs a sequence length")

    @classmethod
    def plan_settings(cls, space):
        """On several ranks, each dp x tp mesh whose degree splits the model's heads evenly and divides
        --gpus-per-node (fsdp+tp:degree=T; tp alone on T ranks)."""
        # the degree divides the attention and key/value heads, MLP width, vocabulary and sequence (read from the
        # workload's configuration: `tensor_parallel_degrees`) and the GPUs of a node, so that no tensor-parallel
        # group straddles two nodes; the largest first. None for a workload without such a configuration.
        ranks = space.context.ranks
        if ranks < 2:
            return []
        return [{"degree": degree} for degree in sorted(tensor_parallel_degrees(space.context.workload),
                                                        reverse=True)
                if ranks % degree == 0 and space.gpus_per_node % degree == 0]

    @classmethod
    def plan_companions(cls, options, space):
        """fsdp, where the mesh has more than one data-parallel replica (`fsdp+tp:degree=T`, torchtitan's FSDP x
        TP): tp alone cannot average their gradients. On CUDA also fsdp with the mixed precision policy torchtitan
        runs its meshes with (parameters in bfloat16, gradients reduced in float32), on one replica too: it is
        how a tensor-parallel step computes in 16 bits (tp refuses amp's autocast)."""
        dp_replicas = space.context.ranks > options.get("degree", cls.options["degree"])
        alternatives = [("fsdp",) if dp_replicas else ()]
        if space.context.device == "cuda":
            alternatives.append(("fsdp:param_dtype=bfloat16:reduce_dtype=float32",))
        return alternatives

    def __init__(self, **options):
        super().__init__(**options)
        if self.settings["degree"] < 1:
            raise UsageError(f"tp:degree={self.settings['degree']} must be at least 1")
        self.mesh_2d = None

    def check(self, context):
        super().check(context)
        degree = self.settings["degree"]
        check_divides_ranks("tp:degree", degree, context.ranks)

    def data_parallel_place(self, rank: int, world: int) -> tuple[int, int]:
        """(this rank's place on the dp dimension, the dp degree): the ranks of a tensor-parallel group share it."""
        degree = self.settings["degree"]
        return rank // degree, world // degree

    def mesh(self):
        """The ranks as a dp x tp mesh of the case's device, tp innermost (consecutive ranks)."""
        from torch.distributed.device_mesh import DeviceMesh

        _forget_other_ranks_meshes(self.context.device)
        _, world = rank_and_world()
        degree = self.settings["degree"]
        table = [[group * degree + i for i in range(degree)] for group in range(world // degree)]
        return DeviceMesh(self.context.device, table, mesh_dim_names=("dp", "tp"))

    def prepare_model(self, model, units):
        """torchtitan's Llama plan (module docstring) over the mesh's tp dimension."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
        )

        degree = self.settings["degree"]
        refusal = tensor_parallel_refusal(model, degree)
        if refusal:
            raise Unsupported(refusal)
        if model.lm_head.weight is model.model.embed_tokens.weight:
            raise Unsupported("tp does not split a tied embedding and LM head (tie_word_embeddings): the split "
                              "would untie them")
        sequence, loss = self.settings["sequence_parallel"], self.settings["loss_parallel"]
        self.mesh_2d = self.mesh()
        tp_mesh = self.mesh_2d["tp"]
        base, layers = _llama_layers(model)
        residual = Shard(1) if sequence else Replicate()
        # the embedding's output whole (transformers' Llama takes the rotary positions from its length), split
        # along the sequence by the first layer's input preparation (module docstring of the Limitations)
        parallelize_module(base, tp_mesh, {"embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                                                           output_layouts=Replicate())})
        parallelize_module(model, tp_mesh, {
            "lm_head": ColwiseParallel(input_layouts=residual,
                                       output_layouts=Shard(-1) if loss else Replicate(),
                                       use_local_output=not loss)})
        if sequence:
            parallelize_module(base, tp_mesh, {"norm": SequenceParallel()})
        for layer in layers:
            plan = {
                "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": residual},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                **{f"self_attn.{n}": ColwiseParallel() for n in ATTENTION_PROJECTIONS[:3]},
                "self_attn.o_proj": RowwiseParallel(output_layouts=residual),
                "mlp": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
                **{f"mlp.{n}": ColwiseParallel() for n in MLP_PROJECTIONS[:2]},
                "mlp.down_proj": RowwiseParallel(output_layouts=residual),
            }
            if sequence:
                plan.update({n: SequenceParallel() for n in LAYER_NORMS})
            parallelize_module(layer, tp_mesh, plan)
        if sequence:  # the whole embedding output -> this rank's part of the sequence, at the first layer's input
            parallelize_module(layers[0], tp_mesh, PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True))
        return model

    def wrap_optimizer(self, optimizer, model):
        """The optimizer as it is, once the model is known to average its gradients across the dp dimension (fsdp's
        sharding over it) where there is more than one data-parallel replica."""
        from torch.distributed.fsdp import FSDPModule

        rank, world = rank_and_world()
        replicas = self.data_parallel_place(rank, world)[1]
        if replicas > 1 and not isinstance(model, FSDPModule):
            raise Unsupported(f"tp:degree={self.settings['degree']} on --ranks {world} leaves {replicas} "
                              f"data-parallel replicas whose gradients nothing averages: compose it with fsdp "
                              f"(fsdp+tp:degree={self.settings['degree']}), or run --ranks "
                              f"{self.settings['degree']}")
        return optimizer

    def forward(self):
        return _CollectivesAsCommunication()

    def prepare_loss(self, loss):
        """The workload's loss, computed on the vocabulary shards of the logits with `loss_parallel`."""
        if not self.settings["loss_parallel"]:
            return loss

        def sharded_loss(output, target):
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel(), _CollectivesAsCommunication():
                return loss(output, target)

        return sharded_loss

    def backward(self, loss):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel() if self.settings["loss_parallel"] else contextlib.nullcontext(), \
                _CollectivesAsCommunication():
            loss.backward()

    def optimizer_step(self, optimizer):
        """The step; without sequence parallelism the norms' weights stay plain tensors beside the DTensors, which
        the optimizer's multi-tensor (`foreach`, CUDA's default) kernels take as replicated
        (`implicit_replication`)."""
        from torch.distributed.tensor.experimental import implicit_replication

        with implicit_replication() if not self.settings["sequence_parallel"] else contextlib.nullcontext():
            optimizer.step()

    def shard_sequence(self, batch):
        """The batch as it is (every rank of a tensor-parallel group trains on all of it); with sequence parallelism,
        refused where the degree does not divide the sequence (DTensor's uneven Shard(1) pieces then meet whole ones
        of the other length in transformers' Llama: "The size of tensor a (16) must match the size of tensor b (15)")."""
        inputs, _ = batch
        ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
        degree = self.settings["degree"]
        if self.settings["sequence_parallel"] and isinstance(ids, torch.Tensor) and ids.dim() > 1 \
                and ids.shape[1] % degree:
            raise Unsupported(f"tp:degree={degree} with sequence_parallel needs a sequence length it divides, not "
                              f"{ids.shape[1]}")
        return batch

    def rank_signature(self, rank, world):
        """Its share of the batch (by its place on the dp dimension): its shards of the parameters, and its piece of
        the sequence, are the same size on every rank (the divisibility `check`, `tensor_parallel_refusal` and
        `shard_sequence` require)."""
        return ("samples", self.samples_of_rank(rank, world))
