"""A small GPT in plain PyTorch, written the way people write one, for Rookery to train.

Token and learned position embeddings, pre-norm blocks (LayerNorm -> attention ->
residual, LayerNorm -> MLP with GELU -> residual), a final LayerNorm and a linear
head. Attention is either written out by hand (q, k, v split from one projection,
scaled scores, a causal mask added as a large negative constant, softmax, dropout)
or `nn.MultiheadAttention` (`mha=True`); Rookery imports both.

The logits come out as `[N, T, V]` (`layout="ntv"`, the default; train with
`loss = { name = "cross_entropy", class_axis = -1 }`) or in torch's own
cross-entropy layout `[N, V, T]` (`layout="nvt"`).
"""

import math
from dataclasses import dataclass

import torch
from torch import nn

# Added to the scores of future positions: exp() of it is 0 in f32, and unlike
# -inf it keeps every softmax row finite.
MASK_VALUE = -1e9


@dataclass
class GPTConfig:
    vocab: int = 4096
    context: int = 128
    layers: int = 6
    d_model: int = 384
    heads: int = 6
    dropout: float = 0.1
    mha: bool = False
    layout: str = "ntv"

    def __post_init__(self):
        if self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of heads {self.heads}")
        if self.layout not in ("ntv", "nvt"):
            raise ValueError(f"layout must be 'ntv' or 'nvt', not {self.layout!r}")


def causal_mask(t: int) -> torch.Tensor:
    """[t, t]: 0 where a position may look (itself and earlier), MASK_VALUE elsewhere."""
    future = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    return torch.zeros(t, t).masked_fill(future, MASK_VALUE)


class SelfAttention(nn.Module):
    """Causal self-attention written out by hand."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.register_buffer("mask", causal_mask(cfg.context), persistent=False)

    def forward(self, x):
        n, t, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(x).split(d, dim=2)
        q = q.view(n, t, self.heads, hd).transpose(1, 2)
        k = k.view(n, t, self.heads, hd).transpose(1, 2)
        v = v.view(n, t, self.heads, hd).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd) + self.mask[:t, :t]
        att = self.attn_drop(torch.softmax(scores, dim=-1))
        y = (att @ v).transpose(1, 2).reshape(n, t, d)
        return self.proj(y)


class TorchAttention(nn.Module):
    """Causal self-attention through `nn.MultiheadAttention`."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.mha = nn.MultiheadAttention(cfg.d_model, cfg.heads, dropout=cfg.dropout, batch_first=True)
        self.register_buffer("mask", causal_mask(cfg.context), persistent=False)

    def forward(self, x):
        t = x.shape[1]
        y, _ = self.mha(x, x, x, attn_mask=self.mask[:t, :t], need_weights=False)
        return y


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = TorchAttention(cfg) if cfg.mha else SelfAttention(cfg)
        self.drop1 = nn.Dropout(cfg.dropout)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x):
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.Sequential(*[Block(cfg) for _ in range(cfg.layers)])
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, tokens):
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device)
        x = self.drop(self.tok(tokens) + self.pos(pos))
        x = self.ln_f(self.blocks(x))
        logits = self.head(x)
        return logits.transpose(1, 2) if self.cfg.layout == "nvt" else logits


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
