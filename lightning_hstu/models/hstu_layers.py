"""HSTU (Hierarchical Sequential Transduction Units, "Actions Speak Louder than Words", Zhai et al. 2024):
the dense part of the generative recommender, in plain PyTorch.

Per layer: U, V, Q, K = split(SiLU(f1(Norm(x)))); A = SiLU(Q K^T + rab(position, time)) / n with a causal
mask, n the sequence's length; y = x + f2(Norm(A V) * U). Sequences arrive padded to the batch's longest
with a mask; padding never attends nor is attended to.
"""

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class HSTUConfig:
    """Sizes of the dense stack (the seed's benchmark: 10 layers, hidden 1024, embedding 128, 4096 long)."""

    embedding_dim: int = 64
    """Width of the token embeddings and of the residual stream."""
    num_layers: int = 2
    num_heads: int = 2
    attention_dim: int = 32
    """Per-head width of Q and K."""
    hidden_dim: int = 32
    """Per-head width of U and V."""
    max_seq_len: int = 200
    """Longest history (relative position biases are learned up to this distance)."""
    time_buckets: int = 64
    """Relative time biases are learned per log2 bucket of the seconds between two events."""
    dropout: float = 0.0


class RelativeBias(nn.Module):
    """rab(p, t): a learned bias per relative position and per log2 bucket of the time between events."""

    def __init__(self, config: HSTUConfig):
        super().__init__()
        self.max_seq_len, self.time_buckets = config.max_seq_len, config.time_buckets
        self.position = nn.Parameter(torch.zeros(config.max_seq_len))
        self.time = nn.Parameter(torch.zeros(config.time_buckets))

    def forward(self, timestamps: torch.Tensor) -> torch.Tensor:
        length = timestamps.shape[1]
        steps = torch.arange(length, device=timestamps.device)
        distance = (steps[:, None] - steps[None, :]).clamp(0, self.max_seq_len - 1)  # causal: i >= j
        seconds = (timestamps[:, :, None] - timestamps[:, None, :]).abs().float()
        bucket = torch.log2(seconds + 1).long().clamp(0, self.time_buckets - 1)
        return self.position[distance][None] + self.time[bucket]  # [B, L, L]


class HSTULayer(nn.Module):
    def __init__(self, config: HSTUConfig):
        super().__init__()
        self.heads, self.attention_dim, self.hidden_dim = config.num_heads, config.attention_dim, config.hidden_dim
        width = config.num_heads * (2 * config.hidden_dim + 2 * config.attention_dim)
        self.norm = nn.LayerNorm(config.embedding_dim)
        self.f1 = nn.Linear(config.embedding_dim, width)
        self.bias = RelativeBias(config)
        self.attention_norm = nn.LayerNorm(config.num_heads * config.hidden_dim)
        self.f2 = nn.Linear(config.num_heads * config.hidden_dim, config.embedding_dim)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, timestamps: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        h, a, d = self.heads, self.attention_dim, self.hidden_dim
        u, v, q, k = F.silu(self.f1(self.norm(x))).split([h * d, h * d, h * a, h * a], dim=-1)
        q = q.view(batch, length, h, a).transpose(1, 2)
        k = k.view(batch, length, h, a).transpose(1, 2)
        v = v.view(batch, length, h, d).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) + self.bias(timestamps)[:, None]  # [B, h, L, L]
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        allowed = causal[None, None] & mask[:, None, None, :] & mask[:, None, :, None]
        n = mask.sum(dim=1).clamp(min=1).to(x.dtype)[:, None, None, None]
        attention = F.silu(scores) * allowed / n  # pointwise, normalised by the sequence length
        y = (attention @ v).transpose(1, 2).reshape(batch, length, h * d)
        return x + self.dropout(self.f2(self.attention_norm(y) * u)) * mask[..., None]


class HSTUStack(nn.Module):
    def __init__(self, config: HSTUConfig):
        super().__init__()
        self.layers = nn.ModuleList(HSTULayer(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.embedding_dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, timestamps: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, mask, timestamps)
        return self.norm(x)


def to_padded(values: torch.Tensor, lengths: torch.Tensor, max_len: int | None = None):
    """Jagged rows (values [N, ...], lengths [B]) -> padded [B, L, ...] and its mask [B, L]."""
    length = int(lengths.max()) if max_len is None else max_len
    mask = torch.arange(length, device=values.device)[None, :] < lengths[:, None]
    padded = values.new_zeros((len(lengths), length, *values.shape[1:]))
    padded[mask] = values
    return padded, mask
