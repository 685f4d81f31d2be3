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
"""

from __future__ import annotations

import contextlib

import torch

from bench.core.errors import Unsupported, UsageError
from bench.core.memory_categories import COMMUNICATION, allocating, made_now
from strategies import register_strategy
from strategies.framework.sharding import Sharded, check_divides_ranks, rank_and_world
from strategies.tp import _CollectivesAsCommunication, _forget_other_ranks_meshes, _llama_layers


def cpu_refusal() -> str | None:
    """Why PyTorch's context parallelism cannot run on the CPU (None where it can), read from PyTorch itself: the
    attention operators its ring attention handles, against the CPU's attention kernel."""
    from torch.distributed.tensor.experimental._context_parallel._attention import custom_ops

    cpu_kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    if cpu_kernel in custom_ops:
        return None
    handled = sorted(str(op) for op in custom_ops if "backward" not in str(op))
    return (f"cp on the CPU: torch {torch.__version__}'s context_parallel runs ring attention for "
            f"{', '.join(handled)} only (CUDA's kernels); the CPU's attention kernel, {cpu_kernel}, has no sharding "
            "strategy registered (NotImplementedError), so neither gloo ranks nor the cpu engine can run it: "
            "predict it with --device cuda")


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

    Limitations: CUDA only, and not checked against real ranks: PyTorch's ring attention handles CUDA's attention
    kernels only (on the CPU the row is `unsupported` and names the kernel), so no gloo run can check it on this
    machine; it is predicted on fake CUDA tensors (`--device cuda`), each rank in turn. It needs a Llama-layout
    transformers model whose inputs are token ids alone, a sequence length that 2 x degree divides (the head-tail
    split), and fsdp beside it (`fsdp+cp`); it does not compose with tp. CUDA's memory-efficient kernel pads its
    log-sum-exp to multiples of 32 tokens, which PyTorch's ring merge cannot broadcast against a shorter local
    sequence: use local sequences of 32 tokens or more. Every rank is traced. The ring runs inside the attention
    operator's DTensor dispatch, where no dispatch mode sees its operators: its all-gathered keys and values (and
    their gradients' exchange) are counted, told to the tracker where the ring makes them (`_filed_as_communication`),
    but its other temporaries inside the operator (each ring step's partial output and log-sum-exp, their merge)
    are not, so the prediction can miss a peak inside attention by those."""

    name = "cp"
    description = "context parallelism: each sample's sequence split over a cp group, ring attention (with fsdp)"
    priority = 65  # its batch split is the one a composition uses (fsdp's is the same method)
    options = {"degree": 2}
    devices = ("cuda",)  # ring attention's kernels (`cpu_refusal`)
    shards_with = ("fsdp",)
    refusals = (*Sharded.refusals, r"cp on the CPU: torch", r"cp:degree=\d+ does not divide --ranks",
                r"cp needs a Llama-layout", r"cp needs fsdp", r"cp:degree=\d+ needs a sequence",
                r"cp: attention did not run as ring attention")

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
        if context.device == "cpu" and (refusal := cpu_refusal()):  # before the base's "needs device cuda": why
            raise Unsupported(refusal)
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
        try:
            with _CollectivesAsCommunication():
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
