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

    def indices(self, timestamps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The relative position [L, L] and time bucket [B, L, L] of every pair: the same for every layer."""
        length = timestamps.shape[1]
        steps = torch.arange(length, device=timestamps.device)
        distance = (steps[:, None] - steps[None, :]).clamp(0, self.max_seq_len - 1)  # causal: i >= j
        seconds = (timestamps[:, :, None] - timestamps[:, None, :]).abs().float()
        bucket = torch.log2(seconds + 1).long().clamp(0, self.time_buckets - 1)
        return distance, bucket

    def forward(self, indices: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        distance, bucket = indices
        return lookup_bias(self.position, distance)[None] + lookup_bias(self.time, bucket)  # [B, L, L]


class _LookupBias(torch.autograd.Function):
    """``table[index]`` for a small table and many indices, whose backward spreads the adds.

    Autograd's own backward of the gather (an accumulating index_put) sorts the indices and then walks the
    duplicates of each entry one after another: with B*L*L indices onto a few dozen time buckets that is
    tens of thousands of sequential adds per entry, which made it the most expensive kernel of the whole
    HSTU step on the GPU. Here consecutive indices add into ``SPREAD`` copies of the table (so that few
    atomic adds meet on one address), summed at the end. No data-dependent shape and no host sync, so a
    CUDA graph can capture it (``bincount`` could not: it reads the largest index on the host)."""

    SPREAD = 128

    @staticmethod
    def forward(ctx, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.entries, ctx.dtype = table.shape[0], table.dtype
        return table[index]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        flat = index.reshape(-1)
        lane = torch.arange(flat.numel(), device=flat.device) % _LookupBias.SPREAD
        copies = torch.zeros(_LookupBias.SPREAD * ctx.entries, dtype=torch.float32, device=grad.device)
        copies.index_add_(0, lane * ctx.entries + flat, grad.reshape(-1).float())
        return copies.view(_LookupBias.SPREAD, ctx.entries).sum(0).to(ctx.dtype), None


def lookup_bias(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return _LookupBias.apply(table, index)


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

    def forward(self, x: torch.Tensor, mask: torch.Tensor, relative: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``relative``: ``RelativeBias.indices`` of the timestamps."""
        batch, length, _ = x.shape
        h, a, d = self.heads, self.attention_dim, self.hidden_dim
        u, v, q, k = F.silu(self.f1(self.norm(x))).split([h * d, h * d, h * a, h * a], dim=-1)
        q = q.view(batch, length, h, a).transpose(1, 2)
        k = k.view(batch, length, h, a).transpose(1, 2)
        v = v.view(batch, length, h, d).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) + self.bias(relative)[:, None]  # [B, h, L, L]
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
        relative = self.layers[0].bias.indices(timestamps) if len(self.layers) else None
        for layer in self.layers:
            x = layer(x, mask, relative)
        return self.norm(x)


class Padding:
    """Where the jagged rows of a batch (lengths [B], N values in all) go in a padded [B, L, ...] tensor,
    computed once for every field of the batch.

    With ``length`` given it never waits for the GPU (the positions are computed from the lengths on the
    device), so it can run ahead of the kernels it launches; rows longer than ``length`` are an error of
    the caller (the data module caps histories at the model's length)."""

    def __init__(self, lengths: torch.Tensor, values: int, length: int | None = None):
        self.length = int(lengths.max()) if length is None else length
        device = lengths.device
        self.mask = torch.arange(self.length, device=device)[None, :] < lengths[:, None]
        self.row = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths, output_size=values)
        self.column = torch.arange(values, device=device) - (torch.cumsum(lengths, 0) - lengths)[self.row]

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        padded = values.new_zeros((len(self.mask), self.length, *values.shape[1:]))
        padded[self.row, self.column] = values
        return padded


def to_padded(values: torch.Tensor, lengths: torch.Tensor, max_len: int | None = None):
    """Jagged rows (values [N, ...], lengths [B]) -> padded [B, L, ...] and its mask [B, L]."""
    padding = Padding(lengths, len(values), max_len)
    return padding(values), padding.mask
