"""Context parallelism (`torch.distributed.tensor.experimental.context_parallel`'s ring attention): each sample's
sequence split across the ranks of a context-parallel group, with FSDP2 over all the ranks, as torchtitan runs it.

`fsdp+cp:degree=C` on N ranks: the ranks form dp x cp groups (`dp = N / C`, the C ranks of a group consecutive); the
batch is split over dp, and each sample's sequence over the C ranks of its group, in torch's head-tail order (rank r
gets chunks r and 2C-1-r of 2C, which balances causal attention's work, as `context_parallel`'s default load
balancer does), with the matching `position_ids`, so each rank runs every layer on 1/C of the tokens. Attention
runs as PyTorch's ring attention (its SDPA patched for the forward and the backward,
`_enable_context_parallel_dispatcher_impl`): the keys and values of the other ranks are all-gathered, and
their buffers are filed as communication. FSDP2 shards the parameters over all N ranks (torchtitan's
`dp_shard_cp` mesh), which also averages the gradients across the context-parallel ranks.

PyTorch's ring dispatches CUDA's attention kernels only; on the CPU its same ring runs around the CPU's kernel
(`_cpu_kernel_in_the_ring`), so that real gloo ranks check the mechanism against the prediction
(tests/test_cp_ranks.py): everything but the kernel inside each ring step is PyTorch's.
"""

from __future__ import annotations

import contextlib

import torch

from bench.core.errors import Unsupported, UsageError
from bench.core.memory_categories import COMMUNICATION, allocating, made_now
from strategies import register_strategy
from strategies.framework.sharding import Sharded, check_divides_ranks, rank_and_world
from strategies.tp import _CollectivesAsCommunication, _forget_other_ranks_meshes, _llama_layers


CPU_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_ATTENTION_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _sequence_sharded(outputs_and_inputs: int, first_input: int):
    """A DTensor sharding strategy for the CPU attention kernel under context parallelism: every tensor, in and out,
    sharded on the sequence (dim 2), as PyTorch's `_sharding_rules` registers for CUDA's kernels."""
    def strategy(op_schema):
        from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
        from torch.distributed.tensor.placement_types import Shard

        mesh = op_schema.get_mesh_from_args(validate=False)
        return expand_to_full_mesh_op_strategy(mesh, op_schema, [[Shard(2)] * outputs_and_inputs],
                                               input_index=first_input)
    return strategy


def _cpu_ring_forward(mesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

    if attn_mask is not None:  # as PyTorch's ring refuses an attn_bias
        raise Unsupported("cp: ring attention takes no attention mask (the inputs must be token ids alone)")
    return _templated_ring_attention(mesh.get_group(), 2, CPU_ATTENTION, query=query, key=key, value=value,
                                     is_causal=is_causal, dropout_p=dropout_p, scale=scale)


def _cpu_ring_backward(mesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                       scale=None):
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention_backward,
    )

    return _templated_ring_attention_backward(mesh.get_group(), 2, CPU_ATTENTION_BACKWARD, grad_out=grad_out,
                                              grad_out_name="grad_out", query=query, key=key, value=value, out=out,
                                              logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p,
                                              scale=scale)


_CPU_RINGS = {CPU_ATTENTION: _cpu_ring_forward, CPU_ATTENTION_BACKWARD: _cpu_ring_backward}


def _cpu_ring_handler(op_call, args, kwargs):
    """PyTorch's `_sdpa_handler` for the CPU kernel: the same propagation and wrapping around its ring."""
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    output_sharding = op_info.output_sharding
    if output_sharding is None or output_sharding.needs_redistribute:
        raise AssertionError(f"cp: {op_call}'s inputs are not all sharded on the sequence")
    local_results = _CPU_RINGS[op_call](op_info.compute_mesh, *op_info.local_args, **op_info.local_kwargs)
    return dispatcher.wrap(local_results, output_sharding.output_spec)


@contextlib.contextmanager
def _cpu_kernel_in_the_ring():
    """PyTorch's ring attention (`_templated_ring_attention` and its backward: the ring, the all-gather of keys and
    values, the merge of partial outputs, the all-to-all of their gradients) run around the CPU's attention kernel,
    which PyTorch's `context_parallel` does not dispatch to a ring (it handles CUDA's flash, memory-efficient and
    cuDNN kernels only, `_attention.custom_ops`): its handler and its sequence sharding registered here, as PyTorch
    registers theirs. Nothing where PyTorch handles the CPU kernel itself."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel._attention import custom_ops
    from torch.distributed.tensor.experimental._context_parallel._sharding_rules import _op_strategy_context

    if CPU_ATTENTION in custom_ops:
        yield
        return
    dispatcher = DTensor._op_dispatcher
    handlers = dispatcher._custom_op_handlers
    dispatcher._custom_op_handlers = {**handlers, **dict.fromkeys(_CPU_RINGS, _cpu_ring_handler)}
    try:
        # forward: output, log-sum-exp; query, key, value. backward: 3 gradients; grad_out, q, k, v, out, lse
        with _op_strategy_context(CPU_ATTENTION, _sequence_sharded(5, 2)), \
                _op_strategy_context(CPU_ATTENTION_BACKWARD, _sequence_sharded(9, 3)):
            yield
    finally:
        dispatcher._custom_op_handlers = handlers


def _filed_as_communication(exchange):
    """A ring rotater's `exchange_buffers`, whose collective's output buffer (the rotater keeps it until the ring
    is done) is counted as communication. The ring runs inside the attention operator's DTensor dispatch, where no
    dispatch mode sees its operators (the live-tensor trackers included): the buffer is told to them here
    (`made_now`)."""
    def exchanged(self, buffer):
        before = {id(value) for value in vars(self).values() if isinstance(value, torch.Tensor)}
        done = exchange(self, buffer)
        made = [value for value in vars(self).values() if isinstance(value, torch.Tensor) and id(value) not in before]
        if made:
            with allocating(COMMUNICATION):
                made_now(made)
        return done

    return exchanged


@register_strategy
class ContextParallel(Sharded):
    """Ring attention over `degree` ranks, each holding 1/degree of every sample's tokens (module docstring); with
    fsdp (`fsdp+cp:degree=C`). Option: `degree`.

    Limitations: on the CPU, PyTorch's ring runs around the CPU's attention kernel, which PyTorch's own
    `context_parallel` does not put in it (`_cpu_kernel_in_the_ring`): real gloo ranks check that (to the byte,
    tests/test_cp_ranks.py); CUDA's kernels in the ring (their log-sum-exp's layout and padding) are predicted on fake
    CUDA tensors only, each rank in turn, and no real CUDA run has checked them. It needs a Llama-layout
    transformers model whose inputs are token ids alone, a sequence length that 2 x degree divides (the head-tail
    split), and fsdp beside it (`fsdp+cp`); it does not compose with tp. CUDA's memory-efficient kernel pads its
    log-sum-exp to multiples of 32 tokens, which PyTorch's ring merge cannot broadcast against a shorter local
    sequence: use local sequences of 32 tokens or more. Every rank is traced. The ring runs inside the attention
    operator's DTensor dispatch, where no dispatch mode sees its operators: its all-gathered keys and values (and
    their gradients' exchange) are counted, told to the tracker where the ring makes them (`_filed_as_communication`),
    but its other temporaries inside the operator (each ring step's partial output and log-sum-exp, their merge)
    are not, so the prediction can miss a peak inside attention by those; on the CPU the real ranks' live-tensor
    tracker misses the same ones, so their to-the-byte agreement does not cover them."""

    name = "cp"
    description = "context parallelism: each sample's sequence split over a cp group, ring attention (with fsdp)"
    priority = 65  # its batch split is the one a composition uses (fsdp's is the same method)
    options = {"degree": 2}
    devices = ("cpu", "cuda")  # on the CPU with its kernel put in the ring (`_cpu_kernel_in_the_ring`)
    shards_with = ("fsdp",)
    refusals = (*Sharded.refusals, r"cp:degree=\d+ does not divide --ranks",
                r"cp needs a Llama-layout", r"cp needs fsdp", r"cp:degree=\d+ needs a sequence",
                r"cp: attention did not run as ring attention",
                r"cp: ring attention takes no attention mask")

    @classmethod
    def plan_settings(cls, space):
        """Never: a mesh shape that splits the sequence, which `plan` does not search."""
        return []

    def __init__(self, **options):
        super().__init__(**options)
        if self.settings["degree"] < 1:
            raise UsageError(f"cp:degree={self.settings['degree']} must be at least 1")
        self.cp_mesh = None

    def check(self, context):
        super().check(context)
        degree = self.settings["degree"]
        check_divides_ranks("cp:degree", degree, context.ranks)

    def data_parallel_place(self, rank: int, world: int) -> tuple[int, int]:
        degree = self.settings["degree"]
        return rank // degree, world // degree

    def mesh(self):
        """This rank's context-parallel group, as a 1-D mesh of the case's device."""
        if self.cp_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            _forget_other_ranks_meshes(self.context.device)
            _, world = rank_and_world()
            degree = self.settings["degree"]
            table = [[group * degree + i for i in range(degree)] for group in range(world // degree)]
            self.cp_mesh = DeviceMesh(self.context.device, table, mesh_dim_names=("dp", "cp"))["cp"]
        return self.cp_mesh

    def prepare_model(self, model, units):
        if _llama_layers(model) is None:
            raise Unsupported(f"cp needs a Llama-layout model (transformers' Llama family, whose attention calls "
                              f"scaled_dot_product_attention and takes position_ids); {type(model).__name__} is not one")
        self.mesh()
        return model

    def wrap_optimizer(self, optimizer, model):
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule):
            raise Unsupported(f"cp needs fsdp beside it (fsdp+cp:degree={self.settings['degree']}): FSDP2 over all "
                              "the ranks averages the gradients of the context-parallel ranks, as torchtitan runs it")
        return optimizer

    def shard_sequence(self, batch):
        """Chunks r and 2C-1-r of 2C of each sequence (input ids, target, and the positions they stand at)."""
        inputs, target = batch
        if not isinstance(inputs, dict) or set(inputs) != {"input_ids"}:
            raise Unsupported("cp needs a Llama-layout model whose inputs are token ids alone (no attention mask)")
        degree, seq_len = self.settings["degree"], inputs["input_ids"].shape[1]
        if seq_len % (2 * degree):
            raise Unsupported(f"cp:degree={degree} needs a sequence length that {2 * degree} divides (its head-tail "
                              f"split), not {seq_len}")
        rank = self.mesh().get_local_rank()
        ids = inputs["input_ids"]
        positions = torch.arange(seq_len, device=ids.device).expand(ids.shape[0], seq_len)

        def head_and_tail(tensor):
            chunks = tensor.chunk(2 * degree, dim=1)
            return torch.cat([chunks[rank], chunks[2 * degree - 1 - rank]], dim=1)

        return {"input_ids": head_and_tail(ids), "position_ids": head_and_tail(positions)}, head_and_tail(target)

    @contextlib.contextmanager
    def _ring_attention(self):
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _cp_options, _disable_context_parallel_dispatcher_impl, _enable_context_parallel_dispatcher_impl,
        )

        from torch.distributed.tensor.experimental._context_parallel import _attention

        balanced = _cp_options.enable_load_balance
        _cp_options.enable_load_balance = True  # the head-tail order `shard_sequence` gave the tokens
        _enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=self.mesh())
        # the ring's collectives run inside the attention operator's DTensor dispatch, below any dispatch mode of
        # this strategy's: their buffers are filed where the ring exchanges its keys and values (and their gradients)
        exchanges = {rotater: rotater.exchange_buffers for rotater in (_attention._AllGatherRotater,
                                                                       _attention._AllToAllRotater)}
        for rotater, exchange in exchanges.items():
            rotater.exchange_buffers = _filed_as_communication(exchange)
        cpu_kernel = _cpu_kernel_in_the_ring() if self.context.device == "cpu" else contextlib.nullcontext()
        try:
            with cpu_kernel, _CollectivesAsCommunication():
                yield
        except RuntimeError as error:
            if "got mixed torch.Tensor and DTensor" not in str(error):
                raise
            raise Unsupported(f"cp: attention did not run as ring attention ({str(error).splitlines()[0]}): PyTorch's "
                              "ring attention handles CUDA's flash, memory-efficient and cuDNN kernels only; a 16-bit "
                              "compute dtype (fsdp:param_dtype=bfloat16) lets CUDA choose one") from None
        finally:
            for rotater, exchange in exchanges.items():
                rotater.exchange_buffers = exchange
            _disable_context_parallel_dispatcher_impl()
            _cp_options.enable_load_balance = balanced

    def forward(self):
        return self._ring_attention()

    def backward(self, loss):
        with self._ring_attention():
            loss.backward()

    def rank_signature(self, rank, world):
        return None
