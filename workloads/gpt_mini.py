"""A small byte-level GPT (decoder-only transformer with dropout), trained on the standard library's source text.

Our own nanoGPT-like code in plain PyTorch: token and learned position embeddings, `layers` pre-LayerNorm blocks
(causal self-attention through `scaled_dot_product_attention`, a 4x-wide GELU MLP), a final LayerNorm and an LM
head tied to the token embedding. Dropout (default 0.1) is applied to the embeddings, to the attention weights and
to each residual branch, so verification exercises a model whose forward draws random numbers.

Parameters at the defaults (layers 6, width 384, heads 6, seq_len 256, vocabulary 256 bytes): 10,844,160
= 6 blocks x 1,774,464 + token embedding 98,304 + position embedding 98,304 + final LayerNorm 768; the head
adds none (it is the token embedding). The text batch depends on the Python version (see
`workloads.framework.text_data`).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from bench.core.errors import UsageError
from workloads import DeferredHead, Workload, register_workload
from workloads.framework import text_data

VOCAB_SIZE = 256  # bytes
INIT_STD = 0.02  # GPT-2


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with attention dropout and a dropped-out output projection."""

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.attention_dropout = dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.residual_dropout = nn.Dropout(dropout)

    def forward(self, x):
        batch, seq_len, width = x.shape
        q, k, v = (t.view(batch, seq_len, self.heads, width // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(width, dim=2))
        dropout_p = self.attention_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
        y = y.transpose(1, 2).contiguous().view(batch, seq_len, width)
        return self.residual_dropout(self.proj(y))


class MLP(nn.Module):
    """Linear width -> 4*width, GELU, linear back, dropout."""

    def __init__(self, width: int, dropout: float):
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = MLP(width, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GptMini(nn.Module):
    """Byte tokens (B, T) -> next-byte logits (B, T, VOCAB_SIZE)."""

    def __init__(self, layers: int, width: int, heads: int, seq_len: int, dropout: float):
        super().__init__()
        self.seq_len = seq_len
        self.token_embedding = nn.Embedding(VOCAB_SIZE, width)
        self.position_embedding = nn.Embedding(seq_len, width)
        self.embedding_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln_final = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, VOCAB_SIZE, bias=False)
        self.lm_head.weight = self.token_embedding.weight
        self.apply(self._init_weights)
        # GPT-2: each residual branch's last projection is scaled down so the residual stream's variance does not
        # grow with depth (two branches per block).
        for block in self.blocks:
            for projection in (block.attn.proj, block.mlp.proj):
                nn.init.normal_(projection.weight, mean=0.0, std=INIT_STD / math.sqrt(2 * layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens):
        return self.lm_head(self.hidden_states(tokens))

    def hidden_states(self, tokens):
        """The final LayerNorm's output (B, T, width): what the LM head maps to the vocabulary."""
        seq_len = tokens.shape[1]
        if seq_len > self.seq_len:
            raise ValueError(f"sequence of {seq_len} tokens is longer than the model's seq_len {self.seq_len}")
        positions = torch.arange(seq_len, device=tokens.device)
        x = self.embedding_dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return self.ln_final(x)


@register_workload
class GptMiniWorkload(Workload):
    """Byte-level GPT, ~10.8M parameters at the defaults, on the stdlib's source; cross-entropy, AdamW, batch 16."""

    name = "gpt_mini"
    description = ("byte-level GPT (6 pre-LN blocks, width 384, 6 heads, seq 256, dropout 0.1, tied head), "
                   "stdlib source text, cross-entropy, AdamW")
    # 16 x 256 tokens: a training step takes ~2 s on 2 CPU threads (measured after warm-up: batch 8 ~1.0 s,
    # batch 16 ~1.9 s), and the ~1.2 GB of tensors saved for backward dwarf the ~174 MB of weights, gradients and
    # AdamW state, so activation-saving strategies have something to save
    default_batch_size = 16
    seed = 0
    data_sources = ("text", "synthetic")
    options = {"layers": 6, "width": 384, "heads": 6, "seq_len": 256, "dropout": 0.1}
    units_chain = True
    learning_rate = 6e-4
    betas = (0.9, 0.95)
    weight_decay = 0.1
    small = ("gpt_mini:layers=2:width=32:heads=2:seq_len=16", 2)  # with dropout: the seeded masks
    small_for = {"peak_in_backward": ("gpt_mini:layers=2:width=32:heads=2:seq_len=16", 4),
                 "fake_cuda": ("gpt_mini:layers=2:width=16:heads=2:seq_len=8", 2)}

    def configure(self) -> None:
        self.require_positive("layers", "width", "heads", "seq_len")
        s = self.settings
        if s["width"] % s["heads"]:
            raise UsageError(f"gpt_mini:width={s['width']} must be a multiple of heads={s['heads']}")
        if not 0.0 <= s["dropout"] < 1.0:
            raise UsageError(f"gpt_mini:dropout={s['dropout']} must be in [0, 1)")

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        s = self.settings
        return GptMini(s["layers"], s["width"], s["heads"], s["seq_len"], s["dropout"])

    def checkpoint_units(self, model: nn.Module) -> list[nn.Module]:
        return list(model.blocks)

    def has_output_head(self) -> bool:
        return True

    def output_head(self, model: nn.Module) -> nn.Linear:
        return model.lm_head

    def hidden_states(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        return model.hidden_states(inputs)

    def loss(self, output: torch.Tensor | DeferredHead, target: torch.Tensor) -> torch.Tensor:
        if isinstance(output, DeferredHead):  # the head and this loss computed by chunks (strategies.chunked_loss)
            return output.loss(target)
        # reshape, not view: a strategy may hand back a non-contiguous output
        return F.cross_entropy(output.reshape(-1, VOCAB_SIZE), target.reshape(-1))

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        # Decay only the Linear layers' matrices. The tied head's weight is the token embedding, which is not
        # decayed; `model.parameters()` yields each shared tensor once, so no parameter lands in two groups.
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        matrices = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)} - embeddings
        decay = [p for p in model.parameters() if id(p) in matrices]
        no_decay = [p for p in model.parameters() if id(p) not in matrices]
        groups = [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=self.learning_rate, betas=self.betas)

    def make_batch(self, batch_size: int, data: str = "text") -> tuple[torch.Tensor, torch.Tensor]:
        seq_len = self.settings["seq_len"]
        if self.check_data(data) == "text":
            return text_data.next_token_windows(batch_size, seq_len, self.seed)
        gen = torch.Generator().manual_seed(self.seed)
        tokens = torch.randint(VOCAB_SIZE, (batch_size, seq_len + 1), generator=gen)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
