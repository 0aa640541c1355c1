"""HSTU (Hierarchical Sequential Transduction Units, "Actions Speak Louder than Words", Zhai et al. 2024):
the dense part of the generative recommender, in plain PyTorch.

Per layer: U, V, Q, K = split(SiLU(f1(Norm(x)))); A = SiLU(Q K^T + rab(position, time)) / n with a causal
mask, n the sequence's length; y = x + f2(Norm(A V) * U).

Two layouts of the same computation. Padded (``HSTUStack.forward``): sequences padded to a length with a
mask, attention in plain PyTorch over ``[B, heads, L, L]`` scores; the reference. Jagged
(``HSTUStack.jagged``): the tokens of every sequence back to back, ``[N, D]``, with offsets; the token-wise
parts run on the real tokens only, and attention is either the fused Triton kernel
(``kernels.hstu_attention``), which never makes an ``L x L`` tensor, or, on the CPU, the padded reference's
attention over groups of sequences of like lengths (``GroupedTokens``). The stack runs the token-wise parts
from one attention to the next as one function (a layer's output, its residual add and the next layer's
norm, f1 and SiLU: ``_layer_boundary``; with the fused kernel the SiLU is the attention's own, whose
backward kernels store the gradients with respect to f1's output); on CUDA ``torch.compile`` can compile
them (``HSTUConfig.compile_layers``), which fuses each norm, cast, SiLU, gating and residual add into one or
two kernels where eager PyTorch runs one kernel per op.
"""

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

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
    """Dropout on each layer's output, before the residual add."""
    position_embedding: bool = False
    """Add a learned absolute position embedding (one row per position up to ``max_seq_len``) to the tokens
    before the first layer: the relative bias says how far apart two events are, this says how far into the
    history an event is."""
    scale_inputs: bool = False
    """Multiply the input tokens by sqrt(embedding_dim) before the position embedding, which keeps the
    embeddings from being drowned by the position rows (both start at the same scale)."""
    input_dropout: float = 0.0
    """Dropout on the input tokens (after the position embedding), before the first layer."""
    autocast_residual: bool = True
    """Under autocast, the residual stream (the tokens from one layer to the next, and their gradients) in
    autocast's dtype (bf16 under Lightning's ``"bf16-mixed"``), as Megatron-LM keeps it
    (``fp32_residual_connection`` off): the stack's input is cast once, after the position embedding and input
    dropout, and every layer boundary reads and writes half the bytes (on the seed shape 0.8 ms less of the step's
    47 ms of kernels on an H100, BENCHMARKS.md). False keeps it in the embeddings' dtype (float32). The norms compute in
    float32 under CUDA's autocast either way, and the stack's output comes back in its input's dtype.
    Without autocast (the CPU's float32 runs) nothing changes."""
    compile_layers: bool = False
    """On the jagged layout on CUDA, run each layer's token-wise parts (norm, f1 and SiLU; the attention
    output's norm, U-gating, f2, dropout and the residual add) through ``torch.compile`` (Inductor, dynamic
    token counts: one compilation for every batch, a second one above 40k tokens). Less GPU time, more host
    time per call: worth it where the dense part is replayed from CUDA graphs (the strategy's
    ``capture_graphs``), a loss where the step waits on the host. The first step pays the compilation
    (tens of seconds on a fresh machine, a few with Inductor's cache). Elsewhere they run eagerly."""


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
        bucket = time_bucket(timestamps[:, :, None] - timestamps[:, None, :], self.time_buckets)
        return distance, bucket

    def forward(self, indices: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        distance, bucket = indices
        return lookup_bias(self.position, distance)[None] + lookup_bias(self.time, bucket)  # [B, L, L]


def time_bucket(gap: torch.Tensor, buckets: int) -> torch.Tensor:
    """floor(log2(1 + |gap|)) of a time gap in seconds, capped at ``buckets - 1``. The seconds are taken in
    float32 and the floor is the float's exponent, which is exact: the fused kernel computes the same
    bucket bit for bit (a rounded log2 would move gaps next to a power of two between buckets)."""
    return (torch.frexp(gap.abs().float() + 1).exponent - 1).clamp(max=buckets - 1).long()


class _LookupBias(torch.autograd.Function):
    """``table[index]`` for a small table and many indices, whose backward spreads the adds.

    Autograd's own backward of the gather (an accumulating index_put) sorts the indices and then walks the
    duplicates of each entry one after another: with B*L*L indices onto a few dozen time buckets that is
    tens of thousands of sequential adds per entry, which made it the most expensive kernel of the whole
    HSTU step on the GPU. There consecutive indices add into ``SPREAD`` copies of the table (so that few
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
        if not grad.is_cuda:  # one thread adds in order on a CPU: the spread's index arithmetic only costs
            table = torch.zeros(ctx.entries, dtype=torch.float32, device=grad.device)
            return table.index_add_(0, flat, grad.reshape(-1).float()).to(ctx.dtype), None
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

    def attend(self, uvqk: torch.Tensor, tokens: "PaddedTokens | JaggedTokens | GroupedTokens"):
        """U and the attention's output from the layer's projection ``uvqk`` (``_layer_inputs``)."""
        return tokens.attention(uvqk, self.heads, self.attention_dim, self.hidden_dim, self.bias)


_BIAS_COLUMNS = 16
"""The columns ``_BiasInProduct`` appends to a linear map's input: a column of ones and 15 of zeros (rows of a
multiple of 16 bytes in bf16 where the width is a multiple of 8; of 8, 16, 64 and 128 columns, 16 made the seed's
weight gradients fastest on an H100, BENCHMARKS.md)."""


class _BiasInProduct(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose backward computes the bias's gradient inside the weight's gradient
    product: the input is kept with a column of ones (and zeros up to ``_BIAS_COLUMNS``), so that
    ``dy^T [x, 1, 0...]`` holds the weight's gradient and, in its column ``width``, the bias's (the column sums of
    ``dy``), where ``F.linear``'s backward reads ``dy`` a second time to sum it. Forward and the input's gradient
    are the same products as ``F.linear``'s. Under autocast the products run in its dtype, as ``F.linear``'s."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        rows, width = x.shape
        extra = x.new_zeros(rows, _BIAS_COLUMNS, dtype=dtype)
        extra[:, 0] = 1
        inputs = torch.cat([x.to(dtype), extra], dim=1)
        w = weight.to(dtype)
        ctx.save_for_backward(inputs, w)
        ctx.dtypes = x.dtype, weight.dtype, bias.dtype
        return torch.addmm(bias.to(dtype), inputs[:, :width], w.t())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inputs, w = ctx.saved_tensors
        width = w.shape[1]
        grad = grad.to(w.dtype)
        both = grad.t() @ inputs  # [out, width + _BIAS_COLUMNS]
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        return (grad @ w).to(x_dtype), both[:, :width].to(w_dtype), both[:, width].to(b_dtype)


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``; inside ``torch.compile`` on 2-d tokens by ``_BiasInProduct``."""
    if torch.compiler.is_compiling() and x.dim() == 2 and layer.bias is not None:
        return _BiasInProduct.apply(x, layer.weight, layer.bias)
    return layer(x)


def _layer_inputs(norm: nn.Module, f1: nn.Module, x: torch.Tensor, activate: bool = True) -> torch.Tensor:
    """SiLU(f1(Norm(x))): U, V, Q and K side by side; without ``activate`` the pre-activations f1(Norm(x)),
    whose SiLU the attention computes (``JaggedTokens.silu``)."""
    projected = _linear(f1, norm(x))
    return F.silu(projected) if activate else projected


def _stack_entry(
    stack: "HSTUStack",
    x: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor | None,
    norm: nn.Module,
    f1: nn.Module,
    activate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stack's input (``HSTUStack._inputs``: scaled, plus the position's embedding, dropout, autocast's
    dtype; with ``mask`` (padded) zero at the padding) and the first layer's inputs computed from it
    (``_layer_inputs``). Compiled as one, the scale, the position rows, dropout and the cast are one pass
    forward, and in backward the residual stream's two gradients (through the first layer and past it) are
    added inside the first norm's backward kernel, with the cast and the scale."""
    x = stack._inputs(x, positions, mask)
    return x, _layer_inputs(norm, f1, x, activate)


def _layer_output(
    norm: nn.Module,
    f2: nn.Module,
    dropout: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    u: torch.Tensor,
    mask: torch.Tensor | None,
    activate_u: bool = False,
) -> torch.Tensor:
    """x + f2(Norm(A V) * U), with dropout before the residual add; with ``mask`` (padded) the padding stays
    as it came in. ``activate_u``: ``u`` is the pre-activation, U = SiLU(u) (the fused attention leaves U's SiLU
    to this function, where compiled it costs no pass of its own)."""
    update = dropout(_linear(f2, norm(y) * (F.silu(u) if activate_u else u)))
    return x + (update if mask is None else update * mask[..., None])


def _layer_boundary(
    norm: nn.Module,
    f2: nn.Module,
    dropout: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    u: torch.Tensor,
    mask: torch.Tensor | None,
    next_norm: nn.Module,
    next_f1: nn.Module,
    activate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What runs between two layers' attentions: a layer's output (the residual stream after it) and the
    next layer's inputs computed from it (``_layer_inputs``); without ``activate`` the attention applies SiLU
    to V, Q and K and this function to U."""
    x = _layer_output(norm, f2, dropout, x, y, u, mask, not activate)
    return x, _layer_inputs(next_norm, next_f1, x, activate)


def _stack_output(
    norm: nn.Module,
    f2: nn.Module,
    dropout: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    u: torch.Tensor,
    mask: torch.Tensor | None,
    final_norm: nn.Module,
    activate_u: bool = False,
) -> torch.Tensor:
    """The last layer's output under the stack's norm."""
    return final_norm(_layer_output(norm, f2, dropout, x, y, u, mask, activate_u))


@functools.cache
def _compiled_token_wise():
    """The token-wise functions compiled once per process (the layers' modules are their arguments, so
    every layer shares the compiled code); dynamic in the token count. Each compiled function spans a layer
    boundary (``_stack_entry``, ``_layer_boundary``): Inductor fuses the residual add into the next norm, and in
    backward the residual stream's two gradients (through the next layer and past it) are added inside the
    norm's backward kernel, where across two functions autograd adds them in a kernel of its own."""
    return tuple(torch.compile(f, dynamic=True) for f in (_stack_entry, _layer_boundary, _stack_output))


class PaddedTokens(NamedTuple):
    """Sequences padded to ``[B, L]``: the reference attention, in plain PyTorch."""

    mask: torch.Tensor
    """[B, L] True at real tokens."""
    relative: tuple[torch.Tensor, torch.Tensor]
    """``RelativeBias.indices`` of the timestamps (the same for every layer)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: RelativeBias) -> torch.Tensor:
        """q, k ``[B, L, heads, attention_dim]``, v ``[B, L, heads, hidden_dim]`` -> ``[B, L, heads, hidden_dim]``."""
        length, mask = q.shape[1], self.mask
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        scores = q @ k.transpose(-1, -2) + bias(self.relative)[:, None]  # [B, h, L, L]
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        allowed = causal[None, None] & mask[:, None, None, :] & mask[:, None, :, None]
        n = mask.sum(dim=1).clamp(min=1).float()[:, None, None, None]
        attention = F.silu(scores) * allowed  # pointwise, normalised by the sequence length (after A V)
        return ((attention @ v) / n).transpose(1, 2)

    def attention(
        self, uvqk: torch.Tensor, heads: int, attention_dim: int, hidden_dim: int, bias: RelativeBias
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """U and the attention's output, both ``[..., heads * hidden_dim]``, from the layer's projection
        ``uvqk`` (U, V, Q, K side by side)."""
        h, a, d = heads, attention_dim, hidden_dim
        u, v, q, k = uvqk.split([h * d, h * d, h * a, h * a], dim=-1)
        y = self.attend(q.unflatten(-1, (h, a)), k.unflatten(-1, (h, a)), v.unflatten(-1, (h, d)), bias)
        return u, y.flatten(-2)


class JaggedTokens(NamedTuple):
    """Sequences back to back: the fused attention kernel."""

    offsets: torch.Tensor
    """[B + 1] the tokens of sequence b are rows ``offsets[b]:offsets[b + 1]``; rows past ``offsets[-1]``
    belong to no sequence (a static capacity): attention gives them zero."""
    timestamps: torch.Tensor
    """[N] each token's time in seconds."""
    max_len: int
    """At least the longest sequence (sizes the kernel's grid)."""
    compiled: bool = False
    """Run the layers' token-wise parts through ``torch.compile`` (``HSTUConfig.compile_layers``)."""
    silu: bool = True
    """The attention takes the projection's pre-activations and applies SiLU to V, Q and K itself
    (``projected_attention(silu=True, silu_u=False)``): the kernels write the gradients with respect to the
    pre-activations, where SiLU's backward would make another pass over the projection's gradient; U's SiLU
    is the layer output's (``_layer_output(activate_u=True)``)."""
    plans: dict | None = None
    """What the kernels read of these sequences' times and lengths, computed by the first layer's attention
    and reused by the others (``projected_attention``'s ``plans``): a new dict per batch; None computes it
    in every layer."""

    def attention(
        self, uvqk: torch.Tensor, heads: int, attention_dim: int, hidden_dim: int, bias: RelativeBias
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``PaddedTokens.attention``, by the fused kernel: its backward writes the gradients of Q, K and
        V into their columns of one gradient for ``uvqk``."""
        from ..kernels.hstu_attention import projected_attention  # Triton: only the jagged layout needs it

        return projected_attention(
            uvqk,
            heads,
            attention_dim,
            hidden_dim,
            self.offsets,
            self.timestamps,
            bias.position,
            bias.time,
            self.max_len,
            self.silu,
            self.plans,
            silu_u=False,  # U's SiLU in the layer's output (``_layer_output``)
        )


GROUP_OVERHEAD = 25_000
"""``GroupedTokens``' price of one more group, in (query, key) pairs of attention: the few dozen PyTorch calls
a group adds per layer, forward and backward, cost about what 25,000 pairs do (a 2-core CPU at ML-100K's
widths, 2026-12-04, ``BENCHMARKS.md``)."""


def length_groups(lengths: list[int], overhead: int = GROUP_OVERHEAD, cuts: int = 64) -> list[list[int]]:
    """The sequences (indices into ``lengths``), longest first, in groups of like lengths: the partition of
    the sorted lengths into runs that costs least, a run costing its size times its longest length squared
    (the pairs its padded attention computes) plus ``overhead``, by dynamic programming over the places
    where the sorted lengths change (a run of equal lengths is never worth splitting). Exact up to ``cuts``
    such places (a batch of a few dozen: well under a millisecond); beyond, over ``cuts`` of them spread
    evenly, so that a batch of thousands costs no more."""
    if not lengths:
        return []
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    changes = [i for i in range(1, len(order)) if lengths[order[i]] != lengths[order[i - 1]]]
    if len(changes) > cuts:
        changes = [changes[k * len(changes) // cuts] for k in range(cuts)]
    points = [0, *changes, len(order)]
    best, cut = [0] + [math.inf] * (len(points) - 1), [0] * len(points)
    for end in range(1, len(points)):  # best[end]: the sequences before points[end] grouped
        for start in range(end):
            size = points[end] - points[start]
            cost = best[start] + size * lengths[order[points[start]]] ** 2 + overhead
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups, end = [], len(points) - 1
    while end:
        groups.append(order[points[cut[end]] : points[end]])
        end = cut[end]
    return groups[::-1]


class GroupedTokens(NamedTuple):
    """Sequences back to back, as ``JaggedTokens``, with attention in plain PyTorch: the sequences in groups
    of like lengths (``length_groups``), each group padded to its longest and attended as ``PaddedTokens``
    does. The token-wise parts run on the real tokens only, and attention computes the pairs of each
    group's length rather than the batch's longest: on ML-100K's batches 45% of the tokens and 36% of the
    pairs that padding the whole batch computes. The groups are read from the offsets on the host (for the
    CPU, where that costs nothing; on a GPU it would wait for the device)."""

    groups: tuple[tuple[torch.Tensor, PaddedTokens], ...]
    """Per group: where its padded ``[b, L]`` tokens are among the rows (``len(rows)``, one past the last, at
    padding), and its ``PaddedTokens``."""
    scatter: torch.Tensor
    """[N] where each row's attention output is among the groups' padded outputs, flattened one after the
    other (their total, one past the last: a zero row, for rows that belong to no sequence): the inverse
    of the groups' gathers."""

    @classmethod
    def of(cls, offsets: torch.Tensor, timestamps: torch.Tensor, bias: "RelativeBias") -> "GroupedTokens":
        """The groups of a batch's sequences (``offsets``, read on the host) and their relative indices
        (``bias.indices``: any layer's, they are alike)."""
        rows, device = len(timestamps), timestamps.device
        starts, lengths = offsets[:-1].tolist(), offsets.diff().tolist()
        times = F.pad(timestamps, (0, 1))  # row ``rows``: the padding's time (masked out)
        groups, gathered = [], [torch.zeros(0, dtype=torch.long, device=device)]
        for members in length_groups(lengths):
            steps = torch.arange(lengths[members[0]], device=device)
            mask = steps < torch.tensor([lengths[s] for s in members], device=device)[:, None]
            gather = torch.where(mask, torch.tensor([starts[s] for s in members], device=device)[:, None] + steps, rows)
            groups.append((gather, PaddedTokens(mask, bias.indices(times[gather]))))
            gathered.append(gather.flatten())
        gathered = torch.cat(gathered)
        scatter = torch.full((rows,), len(gathered), dtype=torch.long, device=device)  # no sequence's: the zero row
        real = gathered < rows
        scatter[gathered[real]] = torch.arange(len(gathered), device=device)[real]
        return cls(tuple(groups), scatter)

    def attention(
        self, uvqk: torch.Tensor, heads: int, attention_dim: int, hidden_dim: int, bias: RelativeBias
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``PaddedTokens.attention``, group by group, on ``[N, ...]`` rows."""
        rows, width = F.pad(uvqk, (0, 0, 0, 1)), heads * hidden_dim  # row N, the padding's: zeros
        flat = []
        for gather, tokens in self.groups:  # index_select: its backward adds the rows, as the gathers do
            padded = rows.index_select(0, gather.flatten()).view(*gather.shape, -1)
            flat.append(tokens.attention(padded, heads, attention_dim, hidden_dim, bias)[1].flatten(0, 1))
        flat.append(uvqk.new_zeros(1, width))  # the rows of no sequence
        return uvqk[:, :width], torch.cat(flat).index_select(0, self.scatter)


class HSTUStack(nn.Module):
    def __init__(self, config: HSTUConfig):
        super().__init__()
        self.config, self.max_seq_len = config, config.max_seq_len
        self.position = nn.Embedding(config.max_seq_len, config.embedding_dim) if config.position_embedding else None
        if self.position is not None:  # at the scale of the (scaled) item rows, not torch's N(0, 1)
            nn.init.trunc_normal_(self.position.weight, std=config.embedding_dim**-0.5)
        self.input_dropout = nn.Dropout(config.input_dropout)
        self.layers = nn.ModuleList(HSTULayer(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.embedding_dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, timestamps: torch.Tensor) -> torch.Tensor:
        """Padded: x ``[B, L, D]``, mask and timestamps ``[B, L]``."""
        relative = self.layers[0].bias.indices(timestamps) if len(self.layers) else None
        tokens = PaddedTokens(mask, relative)
        positions = torch.arange(x.shape[1], device=x.device)[None]
        return self._run(x, positions, tokens).to(x.dtype)

    def jagged(
        self, x: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor, grouped: bool = False
    ) -> torch.Tensor:
        """Jagged: x ``[N, D]``, ``offsets`` ``[B + 1]``, timestamps ``[N]``; sequences of at most
        ``max_seq_len`` tokens. Attention by the fused kernel, or with ``grouped`` in plain PyTorch
        (``GroupedTokens``)."""
        rows = torch.arange(len(x), device=x.device)
        sequence = torch.searchsorted(offsets[1:], rows, right=True).clamp(max=len(offsets) - 2)
        positions = (rows - offsets[sequence]).clamp(0, self.max_seq_len - 1)  # rows past the real ones: any
        if grouped:
            tokens = GroupedTokens.of(offsets, timestamps, self.layers[0].bias) if len(self.layers) else None
        else:
            compiled = self.config.compile_layers and x.is_cuda
            tokens = JaggedTokens(offsets, timestamps, self.max_seq_len, compiled, plans={})
        return self._run(x, positions, tokens).to(x.dtype)

    def _inputs(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The tokens the first layer sees: scaled, plus their position's embedding, with input dropout; under
        autocast in its dtype (``HSTUConfig.autocast_residual``); with ``mask`` (padded) zero at the padding."""
        if self.config.scale_inputs:
            x = x * self.config.embedding_dim**0.5
        if self.position is not None:
            x = x + self.position(positions)
        x = self.input_dropout(x)
        kind = x.device.type
        if self.config.autocast_residual and torch.is_autocast_enabled(kind):
            x = x.to(torch.get_autocast_dtype(kind))  # the residual stream in autocast's dtype
        return x if mask is None else x * mask[..., None]

    def _run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        tokens: PaddedTokens | JaggedTokens | GroupedTokens | None,
    ) -> torch.Tensor:
        """The stack's input (``_inputs``) and the layers, their token-wise parts taken from one attention to
        the next (``_stack_entry``, ``_layer_boundary``); compiled where the tokens say so
        (``JaggedTokens.compiled``)."""
        mask = tokens.mask if isinstance(tokens, PaddedTokens) else None
        if not len(self.layers):
            return self.norm(self._inputs(x, positions, mask))
        plain = (_stack_entry, _layer_boundary, _stack_output)
        entry, boundary, output = _compiled_token_wise() if getattr(tokens, "compiled", False) else plain
        activate = not getattr(tokens, "silu", False)  # the attention's own SiLU (``JaggedTokens.silu``)
        x, uvqk = entry(self, x, positions, mask, self.layers[0].norm, self.layers[0].f1, activate)
        for layer, following in zip(self.layers, self.layers[1:]):
            u, y = layer.attend(uvqk, tokens)
            parts = layer.attention_norm, layer.f2, layer.dropout
            x, uvqk = boundary(*parts, x, y, u, mask, following.norm, following.f1, activate)
        last = self.layers[-1]
        u, y = last.attend(uvqk, tokens)
        return output(last.attention_norm, last.f2, last.dropout, x, y, u, mask, self.norm, not activate)


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
