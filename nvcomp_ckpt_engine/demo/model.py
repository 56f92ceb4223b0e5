"""A tiny byte-level GPT in plain torch, so the demo needs no model hub and no download.

It is small enough to train for a few steps on a CPU in well under a second per step, and has
no dropout and no kernel that sums in a varying order, so the loss of a step depends only on the
weights, the optimizer state and the batch: exactly what a checkpoint plus the data position
restore.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model; the defaults give ~0.1 M parameters."""

    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64


class _Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        # Attention spelled out rather than F.scaled_dot_product_attention, whose fused CUDA
        # kernels may accumulate gradients in a different order from run to run.
        scores = (q @ k.transpose(-2, -1)) * (d // self.n_head) ** -0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Next-byte predictor; `forward(tokens, targets)` returns the mean cross-entropy loss."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        # The loss in fp32 even when DeepSpeed runs the model in bf16: a stable, comparable number.
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
