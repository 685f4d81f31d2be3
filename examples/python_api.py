"""membench from Python: a model defined here, estimated for two GPUs, measured over three steps of this script's own
training loop, and planned, with no workload class and no command line.

    python examples/python_api.py  (from any folder; copy it into your own project as it is)

`workload()` below is also a workload spec the command line takes (`--workload examples/python_api.py:workload`),
which is how tests/test_python_api.py checks that each figure here equals the command line's.
"""

from __future__ import annotations

import torch
from torch import nn

import membench

BATCH = 16


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention (scaled_dot_product_attention) and an MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(b, t, w))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Token embedding, two transformer blocks, a head to the vocabulary."""

    def __init__(self, vocab: int = 512, width: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def make_batch(batch_size: int = BATCH, seq_len: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(512, (batch_size, seq_len + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def workload() -> membench.CallableWorkload:
    """The same model, batch, loss and optimizer as one membench workload (`importable_as` lets the fake-CUDA
    environment's process, which predicts CUDA, rebuild it from this file: named by `__file__`, it is found from
    whatever folder the script runs in, and wherever the script is copied)."""
    return membench.workload_from_callables(TinyTransformer, make_batch(), loss_fn, optimizer, name="tiny_transformer",
                                            checkpoint_units=lambda model: list(model.blocks),
                                            importable_as=f"{__file__}:workload")


def estimates() -> dict[str, membench.Estimate]:
    """The predicted peak of a training step on an RTX 4090 and on an H100."""
    return {gpu: membench.estimate(workload(), gpu=gpu) for gpu in ("RTX 4090", "H100")}


def measured_steps(steps: int = 3) -> membench.Measurement:
    """Three real CPU steps of this script's own loop, measured."""
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = optimizer(model.parameters())
    x, y = make_batch()
    with membench.measure(model, opt, batch=(x, y)) as m:
        for _ in range(steps):
            with m.step():
                pred = model(x)
                loss = loss_fn(pred, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
    return m


def planned() -> membench.Plan:
    """The fastest combination of memory-saving techniques that fits an RTX 4090 at this batch."""
    return membench.plan(workload(), gpu="RTX 4090", max_candidates=4)


if __name__ == "__main__":
    for gpu, estimate in estimates().items():
        print(f"{gpu}: {estimate}  fits: {estimate.fits(gpu)}")
    print(measured_steps().summary())
    print(planned())
