"""A small GPT-style language model (decoder-only transformer) for `train`.

Pre-LayerNorm blocks of causal self-attention and a GELU MLP, learned
position embeddings, no dropout (so runs are reproducible step for step).
"""

import dataclasses
import math

import torch
from torch import nn
from torch.nn import functional as F


@dataclasses.dataclass
class GPTConfig:
    vocab_size: int
    seq_len: int = 64
    dim: int = 256
    layers: int = 4
    heads: int = 4

    def __post_init__(self):
        if self.dim % self.heads:
            raise ValueError(f"model dim {self.dim} is not a multiple of heads {self.heads}")


class _Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.out = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
                if name.endswith("proj.weight") or name.endswith("out.weight"):
                    p.data.mul_(1 / math.sqrt(2 * cfg.layers))
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def num_params(self):
        return sum(p.numel() for p in self.parameters())
