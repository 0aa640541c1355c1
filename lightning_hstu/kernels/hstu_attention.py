"""HSTU attention over jagged sequences, fused in Triton.

For each sequence of ``n`` tokens and each head (query ``i``, key ``j <= i``, both positions inside the
sequence)::

    s[i, j] = q_i . k_j + position[min(i - j, P - 1)] + time[min(bucket(|t_i - t_j|), T - 1)]
    out_i   = sum_j SiLU(s[i, j]) / n * v_j

with ``bucket(seconds) = floor(log2(1 + seconds))``, seconds taken in float32 (the exponent of the float:
exact, the same in every implementation). The two bias tables are shared by the heads (one pair per
layer). Sequences are given as rows ``offsets[b]:offsets[b + 1]`` of ``[N, heads, dim]`` tensors; no
``[B, heads, L, L]`` or ``[B, L, L]`` tensor is ever made: each program keeps a ``BLOCK_M x BLOCK_N`` tile
of scores in registers and reads the bias tables (a few kB) where it needs them. Whether a tile's gaps all
fall in one time bucket (its time bias then one number) is decided from the time ranges of its query and
key blocks: the earliest and latest time of each block of tokens, made by one small kernel per call. Only
tiles whose gaps span several buckets use their timestamps; the forward reads the next key block's time range
and timestamps a tile ahead in its loop over the keys before the diagonal, so that their loads wait behind the
current tile's products.
The forward and the dq kernel read each tile's keys and values, and the dk/dv kernel each tile's queries
and output gradients, by TMA (descriptors of the [tokens, heads, dim] tensors); the bias tables are read in
the matrix product's register layout (loads in inline PTX), not through shared memory.

Backward in two kernels, without atomics on the large gradients (so dq, dk and dv are deterministic):
one program per block of keys walks the queries after it and accumulates dk and dv; one program per block
of queries walks the keys before it and accumulates dq and the bias gradients (in the dk/dv kernel, whose
two accumulators already fill the registers, they spilled). Both recompute the scores, unless the launch
settings store the score gradients (``store_ds``, every head width in bf16): then the dk/dv kernel also
writes each tile's score gradients, in q's dtype and by TMA, and the dq kernel (``_hstu_bwd_dq_stored``)
reads them back, one matrix product per tile instead of three. They go to a buffer of one call, per head
each sequence's keys (rounded up to the largest tile side) by ``max_len`` columns: about heads x tokens x
max_len elements (0.76 GB at the seed benchmark's batch of 22,070 tokens), written and read only where a
tile is causal; a sequence's rows start at its first token's row plus a tile side per sequence before it, so
the kernels place them from the offsets alone. Not a [B, heads, L, L] tensor, but one that grows as
tokens x max_len.
Where the launch settings also say ``store_s`` (heads of 256 in bf16), the forward writes each causal tile's
scores (bias included, in q's dtype, by TMA) into that buffer, made in the forward and kept for the backward,
and the dk/dv kernel reads them (``SCORES_STORED``) instead of recomputing the product and the bias, then
overwrites them with their gradients: a buffer per layer held from forward to backward, not only during one
layer's backward. A call under ``torch.no_grad`` stores no scores.
Where the launch settings name a ``dk`` kernel (heads of 256 in bf16), the dk/dv kernel accumulates dv
alone and writes the score gradients; ``_hstu_bwd_dk_stored`` then makes dk from them, a plain product per
tile with one accumulator (two accumulators of [keys, 256] fp32 filled the dk/dv kernel's registers).
Where they also name a ``time`` pass, the time table's gradient is summed from the stored score gradients by
a kernel of its own (``_hstu_bwd_time_stored``, per block of keys: a tile of one bucket by one sum, the
others bucket by bucket), and the dq kernel makes dq alone.
The bias gradients are sums of the score gradient over the pairs that share a table entry: per tile, the
position table's (one entry per diagonal) from the tile with each row rotated by its index, summed over
rows (in the dq kernel; the dk/dv kernel gathers each diagonal, a tile four times larger); the time
table's are one sum when every gap of the tile falls in one bucket (usual away from the diagonal: log2
buckets are wide there, and the forward then adds one number for the whole tile too; where square dq tiles
also sum the positions, that sum is taken from the position sums' two vectors rather than from the tile), else one
sum per bucket of the tile's range (in the dq kernel along the tile's axis that stays inside a warp, added
across warps once per eight buckets). The position sums go to the table's gradient by atomic adds per tile; the
time sums stay in the program's registers (one per bucket) and are added once at its end. Where the score
gradients are stored and the launch settings say ``bands`` (bf16), the position sums leave the dq
kernel for a kernel of their own, ``_hstu_bwd_position_bands``: every tile of one band (key block kb, query
block kb + band) has the same distance at the same place, so it adds a band's stored tiles elementwise and
rotates and sums the diagonals once per band rather than once per tile. Where the launch settings say
``sums_beside``, the time pass and the position bands run on a second stream, beside the dk and dq kernels,
which read the same stored score gradients. The atomic adds'
order varies from run to run: the bias tables' gradients are reproducible to fp32 rounding, not bit for bit.

Every kernel starts the blocks with the most tiles first within each sequence; the launch settings' ``ORDER``
also puts the longest sequences first, or the blocks of most tiles in the whole batch (``_program``).

Tokens past ``offsets[-1]`` belong to no sequence: their output is zero and they get no gradient (a static
capacity for CUDA graphs); the programs of one more sequence index than the batch has write those zeros, so
no output or gradient is filled beforehand. Programs of blocks past a sequence's end exit at once, so the
grid can be sized by the longest sequence the model allows rather than by the batch's (no host sync).
"""

import contextlib

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _silu(s, FAST: tl.constexpr):
    """SiLU(s) = s sigmoid(s) and its derivative sigmoid(s) (1 + s (1 - sigmoid(s))). ``FAST``: from
    t = tanh(s / 2) (one MUFU op, tanh.approx, about 11 bits, instead of an exponential and a reciprocal),
    with sigmoid(s) = (1 + t) / 2: SiLU = h + h t and the derivative (1 + t) / 2 + h (1 - t^2) / 2 for
    h = s / 2 (three and four FMA-unit ops)."""
    if FAST:
        h = 0.5 * s
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [h], dtype=tl.float32, is_pure=True, pack=1)
        return h + h * t, (0.5 + 0.5 * t) + (0.5 * h) * (1.0 - t * t)
    else:
        sig = 1.0 / (1.0 + tl.exp(tl.minimum(-s, 80.0)))  # exp(80) is finite in fp32: no overflow
        return s * sig, sig * (1.0 + s * (1.0 - sig))


@triton.jit
def _bucket(gap, num_buckets):
    """floor(log2(1 + |gap|)) of seconds in float32, capped: the exponent of the float, exactly."""
    seconds = tl.abs(gap.to(tl.float32)) + 1.0
    return tl.minimum((seconds.to(tl.int32, bitcast=True) >> 23) - 127, num_buckets - 1)


@triton.jit
def _time_range(ranges, first, BLOCK: tl.constexpr, RANGE_BLOCK: tl.constexpr):
    """The earliest and latest time of tokens ``first:first + BLOCK`` of a sequence, from its per-block ranges."""
    GROUPS: tl.constexpr = (BLOCK + RANGE_BLOCK - 1) // RANGE_BLOCK
    g = first // RANGE_BLOCK + tl.arange(0, GROUPS)
    return tl.min(tl.load(ranges + 2 * g)), tl.max(tl.load(ranges + 2 * g + 1))


@triton.jit
def _time_ranges(timestamps, offsets, ranges, blocks, RANGE_BLOCK: tl.constexpr):
    """Per sequence and block of ``RANGE_BLOCK`` tokens, its earliest and latest time (``ranges`` [sequences,
    blocks, 2]); blocks past the sequence's end get (2^62, -2^62), which no min or max picks up."""
    block, seq = tl.program_id(0), tl.program_id(1)
    start, n = _sequence(offsets, seq)
    index = block * RANGE_BLOCK + tl.arange(0, RANGE_BLOCK)
    ok = index < n
    t = tl.load(timestamps + start + index, mask=ok, other=0).to(tl.int64)
    out = ranges + 2 * (seq * blocks + block)
    tl.store(out, tl.min(tl.where(ok, t, 2**62)))
    tl.store(out + 1, tl.max(tl.where(ok, t, -(2**62))))


@triton.jit
def _bucket_range(ti_min, ti_max, tj_min, tj_max, num_buckets):
    """The lowest and highest time bucket of the pairs between two blocks of tokens, from their time ranges.
    Far from the diagonal a tile's gaps usually share one bucket (log2 buckets are wide there): the tile's time
    bias is then one number."""
    lowest = tl.maximum(tl.maximum(ti_min - tj_max, tj_min - ti_max), 0)
    highest = tl.maximum(ti_max - tj_min, tj_max - ti_min)
    return _bucket(lowest, num_buckets), _bucket(highest, num_buckets)


@triton.jit
def _read(pointers, FAST: tl.constexpr):
    """The values (fp32 or int64) at a tensor of pointers into a read-only table, in the layout the caller
    computes in. ``tl.load`` gets a layout of its own from Triton's coalescing pass, which for these gathers
    meant a round trip through shared memory, with a barrier, at every tile to reach the matrix product's
    layout; an elementwise load in inline PTX (``FAST``: compiled for a GPU) takes its operand's."""
    if FAST:
        wide: tl.constexpr = pointers.dtype.element_ty == tl.int64
        values = tl.inline_asm_elementwise(
            "ld.global.nc.b64 $0, [$1];" if wide else "ld.global.nc.f32 $0, [$1];",
            "=l,l" if wide else "=r,l",
            [pointers],
            dtype=pointers.dtype.element_ty,
            is_pure=True,
            pack=1,
        )
    else:
        values = tl.load(pointers)
    return values


@triton.jit
def _bias(
    offset,
    local,
    ts_known,
    ts_pointers,
    low,
    high,
    position_table,
    time_table,
    num_positions,
    num_buckets,
    MASKED: tl.constexpr,
    CLAMP: tl.constexpr,
    FAST: tl.constexpr,
    ts_values=None,
):
    """rab of a tile's pairs and each pair's time bucket (``low`` and ``high``: the tile's bucket range).
    A pair's distance i - j is ``offset`` (the tile's, a scalar) plus ``local`` (its place in the tile, the
    same tensor for every tile): off the diagonal (not ``MASKED``) every distance lies in [1, num_positions)
    unless ``CLAMP``, so the table is read at one address per tile plus constant offsets. The times of one
    side of the tile are in registers (``ts_known``); the other side's are read (``ts_pointers``, valid
    addresses for every pair) only when the tile's gaps span several buckets, unless the caller read them
    ahead (``ts_values``; the gap's sign does not matter). Pairs with j > i are masked by the caller."""
    if CLAMP:
        position = _read(position_table + tl.minimum(tl.maximum(offset + local, 0), num_positions - 1), FAST)
    elif MASKED:
        position = _read(position_table + tl.maximum(offset + local, 0), FAST)
    else:
        position = _read((position_table + offset) + local, FAST)
    if low == high:  # one bucket for the whole tile
        bias = position + tl.load(time_table + low)
        bucket = tl.full(position.shape, 0, tl.int32) + low
    else:
        other = _read(ts_pointers, FAST) if ts_values is None else ts_values
        bucket = _bucket(ts_known - other, num_buckets)
        bias = position + _read(time_table + bucket, FAST)
    return bias, bucket


@triton.jit
def _rows(base, index, ok, stride, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """Rows ``index`` (zero where not ``ok``) of a [tokens, WIDTH] view: a [len(index), BLOCK] tile."""
    w = tl.arange(0, BLOCK)
    pointers = base + index[:, None] * stride + w[None, :]
    if BLOCK == WIDTH:
        return tl.load(pointers, mask=ok[:, None], other=0.0)
    else:
        return tl.load(pointers, mask=ok[:, None] & (w < WIDTH)[None, :], other=0.0)


@triton.jit
def _store_rows(base, index, ok, stride, value, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    w = tl.arange(0, BLOCK)
    pointers = base + index[:, None] * stride + w[None, :]
    if BLOCK == WIDTH:
        tl.store(pointers, value.to(base.dtype.element_ty), mask=ok[:, None])
    else:
        tl.store(pointers, value.to(base.dtype.element_ty), mask=ok[:, None] & (w < WIDTH)[None, :])


@triton.jit
def _store_grad_rows(base, pre, offset, index, ok, stride, value, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """``_store_rows`` of a gradient at ``base + offset``. Where ``pre`` is given (a tensor of the same layout
    holding the pre-activations x of the projection, ``projected_attention(silu=True)``), the gradient with
    respect to x: the value times SiLU'(x), in fp32 before the one rounding of the store."""
    if pre is None:
        _store_rows(base + offset, index, ok, stride, value, WIDTH, BLOCK)
    elif BLOCK == WIDTH and BLOCK >= 128:  # in quarters of columns: a whole row's x and SiLU' would spill
        QUARTER: tl.constexpr = BLOCK // 4
        left, right = _column_halves(value, BLOCK // 2)
        a, b = _column_halves(left, QUARTER)
        _store_grad_columns(base, pre, offset, index, ok, stride, a, QUARTER)
        _store_grad_columns(base, pre, offset + QUARTER, index, ok, stride, b, QUARTER)
        c, d = _column_halves(right, QUARTER)
        _store_grad_columns(base, pre, offset + 2 * QUARTER, index, ok, stride, c, QUARTER)
        _store_grad_columns(base, pre, offset + 3 * QUARTER, index, ok, stride, d, QUARTER)
    else:
        _store_grad_columns(base, pre, offset, index, ok, stride, value, BLOCK, WIDTH)


@triton.jit
def _column_halves(value, HALF: tl.constexpr):
    """A [rows, 2 HALF] tile's first and last ``HALF`` columns."""
    return tl.split(tl.permute(tl.reshape(value, [value.shape[0], 2, HALF]), (0, 2, 1)))


@triton.jit
def _store_grad_columns(base, pre, offset, index, ok, stride, value, BLOCK: tl.constexpr, WIDTH: tl.constexpr = None):
    """Columns ``offset:offset + BLOCK`` of ``_store_grad_rows`` (of which ``WIDTH`` exist), SiLU' applied."""
    WIDE: tl.constexpr = BLOCK if WIDTH is None else WIDTH
    x = _rows(pre + offset, index, ok, stride, WIDE, BLOCK).to(tl.float32)
    _, derivative = _silu(x, False)
    _store_rows(base + offset, index, ok, stride, value * derivative, WIDE, BLOCK)


ORDERS = ("index", "sequences", "blocks")
"""The programs' orders a kernel's launch settings may name (``ORDER``, ``_program``)."""

_SUMS_LOOP_STAGES = tl.constexpr(3)
"""How deep the loops of the bias tables' sum passes (``_hstu_bwd_time_stored``, ``_hstu_bwd_position_bands``)
are pipelined. Their loads feed no dot product, so the launch's ``num_stages`` leaves them unpipelined; three
stages take the seed shape's calls (H200, bf16, heads of 256) from 0.314 to 0.237 ms (time) and from 0.186 to
0.137 ms (position bands)."""


@triton.jit
def _program(ORDER: tl.constexpr, order):
    """The sequence, head and rank of a program: rank 0 starts first in its sequence, and a block's work
    falls as its rank grows, in every sequence alike (each kernel maps a rank to the block with that much
    work in its own sequence; ranks past a sequence's blocks exit). The launch setting ``ORDER`` lays out the
    grid, whose first axis varies fastest:

    - ``"index"``: (ranks, sequences and one more, heads): one sequence after another in the batch's order,
      the heads last;
    - ``"sequences"``: (ranks, heads, sequences and one more), the sequences longest first (``order``, their
      indices by length, made per call): each sequence's programs start side by side and read the same rows
      from the L2 cache, and the short sequences come last;
    - ``"blocks"``: (heads, sequences and one more, ranks), ranks slowest: the blocks of most work in the whole
      batch start first and the short ones fill in after them, at the cost of the L2 cache's sharing.

    No long block should start last and run alone while the other SMs idle. On an H200 (BENCHMARKS.md):
    ``"blocks"`` took the attention's kernels 10-27% less time than ``"index"`` at heads of 128, and made the
    forward 8-19% slower at heads of 256, where ``"sequences"`` took it 8-12% less (the backward's 1-7%)."""
    if ORDER == "blocks":
        return tl.program_id(1), tl.program_id(0), tl.program_id(2)
    if ORDER == "sequences":
        index, count = tl.program_id(2), tl.num_programs(2) - 1
        seq = tl.load(order + index, mask=index < count, other=count).to(tl.int32)  # the rows after the batch last
        return seq, tl.program_id(1), tl.program_id(0)
    return tl.program_id(1), tl.program_id(2), tl.program_id(0)


@triton.jit
def _ranks(ORDER: tl.constexpr):
    """How many ranks the grid has (the longest sequence's blocks at least)."""
    return tl.num_programs(2) if ORDER == "blocks" else tl.num_programs(0)


@triton.jit
def _is_tail(seq, ORDER: tl.constexpr):
    """Whether ``seq`` is the grid's last sequence index, one past the batch's: the rows after the batch."""
    return seq == (tl.num_programs(2) if ORDER == "sequences" else tl.num_programs(1)) - 1


@triton.jit
def _write_tail(
    dst,
    src,
    offsets,
    tokens,
    dst_stride,
    src_stride,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    ORDER: tl.constexpr,
    order,
):
    """For the programs of the grid's last sequence index (one past the batch's): writes the rows after the
    last sequence (``offsets[-1]:tokens``, the capacity's padding) of a [tokens, WIDTH] view ``dst``, ``ROWS``
    rows per step, the programs of one head taking turns in rank order: zeros where ``src`` is None, else the
    same rows of the [tokens, WIDTH] view ``src``."""
    seq, _, rank = _program(ORDER, order)
    step = _ranks(ORDER) * ROWS
    for row in range(tl.load(offsets + seq).to(tl.int32) + rank * ROWS, tokens, step):
        rows = (row + tl.arange(0, ROWS)).to(tl.int64)
        ok = rows < tokens
        if src is None:
            values = tl.zeros([ROWS, BLOCK], tl.float32)
        else:
            values = _rows(src, rows, ok, src_stride, WIDTH, BLOCK)
        _store_rows(dst, rows, ok, dst_stride, values, WIDTH, BLOCK)


@triton.jit
def _zero_tail(
    base,
    offsets,
    tokens,
    stride,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    ORDER: tl.constexpr,
    order,
):
    """``_write_tail`` of zeros into ``base``."""
    _write_tail(base, None, offsets, tokens, stride, 0, WIDTH, BLOCK, ROWS, ORDER, order)


@triton.jit
def _sequence(offsets, seq):
    start = tl.load(offsets + seq).to(tl.int64)
    return start, (tl.load(offsets + seq + 1) - start).to(tl.int32)


@triton.jit
def _query_tile(
    q,
    k,
    ts_i,
    first,
    key,
    ts,
    tj_min,
    tj_max,
    ti_min,
    ti_max,
    position_table,
    time_table,
    n,
    num_positions,
    num_buckets,
    MASKED: tl.constexpr,
    PRECISION: tl.constexpr,
    FAST: tl.constexpr,
    CLAMP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ts_j=None,
):
    """For the query rows ``first:first + BLOCK_M`` and the keys ``k`` (``key:key + BLOCK_N``): SiLU of the
    [queries, keys] scores (bias included) and its derivative, each pair's time bucket, the tile's bucket
    range, and the scores."""
    cols = key + tl.arange(0, BLOCK_N)
    low, high = _bucket_range(ti_min, ti_max, tj_min, tj_max, num_buckets)
    bias, bucket = _bias(
        first - key,
        tl.arange(0, BLOCK_M)[:, None] - tl.arange(0, BLOCK_N)[None, :],
        ts_i[:, None],
        (ts + tl.minimum(cols, n - 1))[None, :],
        low,
        high,
        position_table,
        time_table,
        num_positions,
        num_buckets,
        MASKED,
        CLAMP,
        FAST,
        ts_j,
    )
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) + bias
    p, dsilu = _silu(s, FAST)
    return p, dsilu, bucket, low, high, s


@triton.jit
def _fwd_tile(
    acc,
    q,
    ts_i,
    rows,
    first,
    key,
    K,
    V,
    start,
    head,
    ts,
    tj_min,
    tj_max,
    ti_min,
    ti_max,
    position_table,
    time_table,
    n,
    num_positions,
    num_buckets,
    BLOCK_A: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    PRECISION: tl.constexpr,
    FAST: tl.constexpr,
    CLAMP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    S,
    s_row,
    STORE_S: tl.constexpr,
    ts_j=None,
):
    """One [queries, keys] tile of the forward; the keys and values arrive by TMA (``K`` and ``V`` are
    descriptors of the [tokens, heads, dim] tensors; rows past the sequence's end belong to the next one or
    are zero past the tensor's, and their pairs are masked). ``STORE_S``: the tile's scores also go to ``S``
    (a descriptor of [keys, queries] rows, the sequence's and head's keys from row ``s_row``), by TMA, for the
    dk/dv kernel."""
    k = tl.reshape(K.load([start + key, head, 0]), [BLOCK_N, BLOCK_A])
    v = tl.reshape(V.load([start + key, head, 0]), [BLOCK_N, BLOCK_D])
    p, _, _, _, _, s = _query_tile(
        q,
        k,
        ts_i,
        first,
        key,
        ts,
        tj_min,
        tj_max,
        ti_min,
        ti_max,
        position_table,
        time_table,
        n,
        num_positions,
        num_buckets,
        MASKED,
        PRECISION,
        FAST,
        CLAMP,
        BLOCK_M,
        BLOCK_N,
        ts_j,
    )
    if STORE_S:
        S.store([s_row + key, first], tl.trans(s).to(v.dtype))
    if MASKED:
        p = tl.where(rows[:, None] >= (key + tl.arange(0, BLOCK_N))[None, :], p, 0.0)
    return acc + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)


@triton.jit(do_not_specialize=["tokens", "s_head_rows"])
def _hstu_fwd(
    Q,
    K,
    V,
    Out,
    S,
    s_side,
    s_head_rows,
    offsets,
    tokens,
    timestamps,
    ranges,
    range_blocks,
    position_table,
    time_table,
    stride_qn,
    stride_qh,
    stride_on,
    stride_oh,
    num_positions,
    num_buckets,
    ATTENTION_DIM: tl.constexpr,
    HIDDEN_DIM: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    FAST: tl.constexpr,
    CLAMP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RANGE_BLOCK: tl.constexpr,
    STORE_S: tl.constexpr,
    ORDER: tl.constexpr,
    order,
):
    seq, head, rank = _program(ORDER, order)
    block = _ranks(ORDER) - 1 - rank  # the last rows (most keys) first
    if _is_tail(seq, ORDER):
        _zero_tail(Out + head * stride_oh, offsets, tokens, stride_on, HIDDEN_DIM, BLOCK_D, BLOCK_M, ORDER, order)
        return
    start, n = _sequence(offsets, seq)
    first = block * BLOCK_M
    if first >= n:
        return
    Q += start * stride_qn + head * stride_qh
    ts = timestamps + start
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    q = _rows(Q, rows, row_ok, stride_qn, ATTENTION_DIM, BLOCK_A)
    ts_i = tl.load(ts + rows, mask=row_ok, other=0)
    ranges += 2 * seq * range_blocks
    ti_min, ti_max = _time_range(ranges, first, BLOCK_M, RANGE_BLOCK)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    s_row = _ds_row(s_side, s_head_rows, start, seq, head, STORE_S)
    tj_min, tj_max = _time_range(ranges, 0, BLOCK_N, RANGE_BLOCK)
    ts_j = _read((ts + tl.minimum(tl.arange(0, BLOCK_N), n - 1))[None, :], FAST)
    for key in range(0, first, BLOCK_N):  # keys before the block: every pair is causal
        # the next key block's time range and times read a tile ahead (their latency behind this tile's work)
        next_min, next_max = _time_range(ranges, key + BLOCK_N, BLOCK_N, RANGE_BLOCK)
        next_ts = _read((ts + tl.minimum(key + BLOCK_N + tl.arange(0, BLOCK_N), n - 1))[None, :], FAST)
        acc = _fwd_tile(
            acc,
            q,
            ts_i,
            rows,
            first,
            key,
            K,
            V,
            start.to(tl.int32),
            head,
            ts,
            tj_min,
            tj_max,
            ti_min,
            ti_max,
            position_table,
            time_table,
            n,
            num_positions,
            num_buckets,
            BLOCK_A,
            BLOCK_D,
            False,
            PRECISION,
            FAST,
            CLAMP,
            BLOCK_M,
            BLOCK_N,
            S,
            s_row,
            STORE_S,
            ts_j,
        )
        tj_min, tj_max = next_min, next_max
        ts_j = next_ts
    for key in range(first, tl.minimum(first + BLOCK_M, n), BLOCK_N):  # the diagonal: masked
        tj_min, tj_max = _time_range(ranges, key, BLOCK_N, RANGE_BLOCK)
        acc = _fwd_tile(
            acc,
            q,
            ts_i,
            rows,
            first,
            key,
            K,
            V,
            start.to(tl.int32),
            head,
            ts,
            tj_min,
            tj_max,
            ti_min,
            ti_max,
            position_table,
            time_table,
            n,
            num_positions,
            num_buckets,
            BLOCK_A,
            BLOCK_D,
            True,
            PRECISION,
            FAST,
            CLAMP,
            BLOCK_M,
            BLOCK_N,
            S,
            s_row,
            STORE_S,
        )
    _store_rows(
        Out + start * stride_on + head * stride_oh, rows, row_ok, stride_on, acc / n.to(tl.float32), HIDDEN_DIM, BLOCK_D
    )


@triton.jit
def _position_grads(ds, base, d_position, scale, num_positions, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Adds the diagonal sums of a [queries, keys] tile ``ds`` (query i = base + r, key j = c: distance
    base + r - c) to the position table's gradient. Row r is rotated left by r mod BLOCK_N (a gather as
    large as the tile, where gathering every diagonal would be four times larger): in the rotated tile,
    column c of row block g holds distance base + g BLOCK_N - c where the rotation did not wrap and one
    block further where it did. Needs BLOCK_N to divide BLOCK_M."""
    GROUPS: tl.constexpr = BLOCK_M // BLOCK_N
    r = tl.arange(0, BLOCK_M)[:, None]
    c = tl.arange(0, BLOCK_N)[None, :]
    rolled = tl.reshape(tl.gather(ds, (c + r) % BLOCK_N, 1), [GROUPS, BLOCK_N, BLOCK_N])
    wrapped = (tl.arange(0, BLOCK_N)[:, None] + c >= BLOCK_N)[None, :, :]
    straight = tl.sum(tl.where(wrapped, 0.0, rolled), 1)  # [GROUPS, BLOCK_N]
    over = tl.sum(tl.where(wrapped, rolled, 0.0), 1)
    distance = base + tl.arange(0, GROUPS)[:, None] * BLOCK_N - c  # [GROUPS, BLOCK_N]
    tl.atomic_add(
        d_position + tl.minimum(tl.maximum(distance, 0), num_positions - 1),
        straight * scale,
        mask=distance >= 0,
        sem="relaxed",
    )
    tl.atomic_add(
        d_position + tl.minimum(distance + BLOCK_N, num_positions - 1),
        over * scale,
        mask=distance + BLOCK_N >= 0,
        sem="relaxed",
    )
    return tl.sum(straight) + tl.sum(over)  # the tile's sum (ds is zero past the diagonal); used where GROUPS == 1


@triton.jit
def _bias_grads(
    ds,
    bucket,
    low,
    high,
    base,
    d_position,
    dtime,
    scale,
    num_positions,
    KEYS_FIRST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SKEW: tl.constexpr,
    TIME_BLOCK: tl.constexpr,
    POSITIONS: tl.constexpr,
):
    """Adds a tile's score gradients ``ds`` to the bias tables' gradients: per position entry the sum over
    a diagonal (i - j = ``base`` + e - (BLOCK_N - 1) for the tile's diagonal e), atomically, unless not
    ``POSITIONS`` (another kernel sums them); per time bucket the sum over the pairs in it, into the
    program's ``dtime`` (``TIME_BLOCK`` sums in registers, added to the table's gradient once at the
    program's end). ``ds`` is [keys, queries] if ``KEYS_FIRST`` else [queries, keys]. Returns ``dtime``."""
    if not POSITIONS:
        pass
    elif KEYS_FIRST:  # the query column of diagonal e in key row c: c + e - (BLOCK_N - 1)
        diagonal = tl.arange(0, SKEW)
        skew = tl.arange(0, BLOCK_N)[:, None] + diagonal[None, :] - (BLOCK_N - 1)
        skew_ok = (skew >= 0) & (skew < BLOCK_M)
        per_diagonal = tl.sum(tl.where(skew_ok, tl.gather(ds, tl.where(skew_ok, skew, 0), 1), 0.0), 0)
        distance = base + diagonal - (BLOCK_N - 1)
        tl.atomic_add(
            d_position + tl.minimum(distance, num_positions - 1),
            per_diagonal * scale,
            mask=(distance >= 0) & (diagonal < BLOCK_M + BLOCK_N - 1),
            sem="relaxed",
        )
    else:
        total = _position_grads(ds, base, d_position, scale, num_positions, BLOCK_M, BLOCK_N)
    slots = tl.arange(0, TIME_BLOCK)
    if low == high:  # one bucket for the whole tile (usual away from the diagonal)
        if KEYS_FIRST or BLOCK_M != BLOCK_N or not POSITIONS:
            total = tl.sum(ds)  # from the position sums only where they are one row block (cheaper there)
        dtime += tl.where(slots == low, total, 0.0)
    elif KEYS_FIRST:
        for b in range(low, high + 1):
            dtime += tl.where(slots == b, tl.sum(tl.where(bucket == b, ds, 0.0)), 0.0)
    else:
        dtime = _time_sums(ds, bucket, low, high, dtime, BLOCK_M, BLOCK_N, TIME_BLOCK)
    return dtime


@triton.jit
def _time_sums(ds, bucket, low, high, dtime, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TIME_BLOCK: tl.constexpr):
    """Adds to ``dtime`` the sums of a [queries, keys] tile ``ds`` per time bucket ``low..high``. A whole-tile
    sum per bucket would cross warps (shared memory and two barriers each); here each bucket's sums run along
    the tile's axis that stays inside a warp (the columns of square tiles, whose warps sit side by side in
    the chained product's layout, else the rows) into ``CHUNK`` accumulators, summed across warps once per
    ``CHUNK`` buckets."""
    CHUNK: tl.constexpr = 8
    slots = tl.arange(0, TIME_BLOCK)
    rel = tl.arange(0, CHUNK)
    for first in range(low, high + 1, CHUNK):
        if BLOCK_M == BLOCK_N:
            acc = tl.zeros([CHUNK, BLOCK_N], tl.float32)
            for b in range(first, tl.minimum(first + CHUNK, high + 1)):
                part = tl.sum(tl.where(bucket == b, ds, 0.0), 0)
                acc += tl.where(rel[:, None] == b - first, part[None, :], 0.0)
            chunk = tl.sum(acc, 1)
        else:
            acc = tl.zeros([BLOCK_M, CHUNK], tl.float32)
            for b in range(first, tl.minimum(first + CHUNK, high + 1)):
                part = tl.sum(tl.where(bucket == b, ds, 0.0), 1)
                acc += tl.where(rel[None, :] == b - first, part[:, None], 0.0)
            chunk = tl.sum(acc, 0)
        inside = (slots >= first) & (slots < first + CHUNK)
        dtime += tl.where(inside, tl.gather(chunk, tl.where(inside, slots - first, 0), 0), 0.0)
    return dtime


@triton.jit
def _add_time_grads(d_time, dtime, scale, num_buckets, TIME_BLOCK: tl.constexpr):
    slots = tl.arange(0, TIME_BLOCK)
    tl.atomic_add(d_time + slots, dtime * scale, mask=(slots < num_buckets) & (dtime != 0.0), sem="relaxed")


@triton.jit
def _dkdv_tile(
    dk,
    dv,
    dtime,
    k,
    v,
    ts_j,
    cols,
    row,
    first,
    Q,
    dOut,
    start,
    head,
    ts,
    ranges,
    tj_min,
    tj_max,
    d_position,
    position_table,
    time_table,
    n,
    inv_n,
    num_positions,
    num_buckets,
    ATTENTION_DIM: tl.constexpr,
    HIDDEN_DIM: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    PRECISION: tl.constexpr,
    FAST: tl.constexpr,
    CLAMP: tl.constexpr,
    BIAS_GRADS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SKEW: tl.constexpr,
    TIME_BLOCK: tl.constexpr,
    RANGE_BLOCK: tl.constexpr,
    DS,
    ds_row,
    STORE_DS: tl.constexpr,
    SCORES_STORED: tl.constexpr,
    DK: tl.constexpr,
):
    """One [keys, queries] tile (transposed, so that every product takes its left operand as computed). The
    queries and their output gradients arrive by TMA (``Q`` and ``dOut`` are descriptors of the [tokens,
    heads, dim] tensors): rows past the sequence's end belong to the next one, so their pairs are masked.
    ``STORE_DS``: the tile's score gradients also go to ``DS`` (a descriptor of [keys, queries] rows; the
    sequence's and head's keys from row ``ds_row``), by TMA. ``SCORES_STORED``: the forward left the tile's
    scores (bias included) in ``DS`` at the same place: they are read there, not computed again, and the
    score gradients take their place. Not ``DK``: dk is left to ``_hstu_bwd_dk_stored`` (``dk`` passes through)."""
    rows = row + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    if DK or not SCORES_STORED:
        q_t = tl.trans(tl.reshape(Q.load([start + row, head, 0]), [BLOCK_M, BLOCK_A]))  # [A, M]
    do = tl.reshape(dOut.load([start + row, head, 0]), [BLOCK_M, BLOCK_D])
    if SCORES_STORED:  # the forward's, and the bias gradients are summed in the dq kernel
        s = DS.load([ds_row + first, row]).to(tl.float32)  # [N, M]
        bucket, low, high = 0, 0, 0
    else:
        ti_min, ti_max = _time_range(ranges, row, BLOCK_M, RANGE_BLOCK)
        low, high = _bucket_range(ti_min, ti_max, tj_min, tj_max, num_buckets)
        bias, bucket = _bias(
            row - first,
            tl.arange(0, BLOCK_M)[None, :] - tl.arange(0, BLOCK_N)[:, None],
            ts_j[:, None],
            (ts + tl.minimum(rows, n - 1))[None, :],
            low,
            high,
            position_table,
            time_table,
            num_positions,
            num_buckets,
            MASKED,
            CLAMP,
            FAST,
        )
        s = tl.dot(k, q_t, input_precision=PRECISION) + bias  # [N, M]
    p, dsilu = _silu(s, FAST)
    dp = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    ds = dp * dsilu
    if MASKED:
        causal = (rows[None, :] >= cols[:, None]) & row_ok[None, :]
        p = tl.where(causal, p, 0.0)
        ds = tl.where(causal, ds, 0.0)
    elif row + BLOCK_M > n:  # the sequence's last block of queries
        p = tl.where(row_ok[None, :], p, 0.0)
        ds = tl.where(row_ok[None, :], ds, 0.0)
    dv += tl.dot(p.to(do.dtype), do, input_precision=PRECISION)
    if DK:
        dk += tl.dot(ds.to(do.dtype), tl.trans(q_t), input_precision=PRECISION)
    if STORE_DS:
        DS.store([ds_row + first, row], ds.to(do.dtype))
    if BIAS_GRADS:
        dtime = _bias_grads(
            ds,
            bucket,
            low,
            high,
            row - first,
            d_position,
            dtime,
            inv_n,
            num_positions,
            True,
            BLOCK_M,
            BLOCK_N,
            SKEW,
            TIME_BLOCK,
            True,
        )
    return dk, dv, dtime


@triton.jit(do_not_specialize=["tokens", "ds_head_rows"])
def _hstu_bwd_dkdv(
    Q,
    K,
    V,
    dOut,
    dK,
    dV,
    PK,
    PV,
    U_GRAD,
    dU,
    DS,
    ds_side,
    ds_head_rows,
    d_position,
    d_time,
    offsets,
    tokens,
    timestamps,
    ranges,
    range_blocks,
    position_table,
    time_table,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_dkn,
    stride_dkh,
    stride_dvn,
    stride_dvh,
    stride_gun,
    stride_guh,
    stride_dun,
    stride_duh,
    num_positions,
    num_buckets,
    ATTENTION_DIM: tl.constexpr,
    HIDDEN_DIM: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    FAST: tl.constexpr,
    CLAMP: tl.constexpr,
    BIAS_GRADS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SKEW: tl.constexpr,
    TIME_BLOCK: tl.constexpr,
    RANGE_BLOCK: tl.constexpr,
    STORE_DS: tl.constexpr,
    SCORES_STORED: tl.constexpr,
    DK: tl.constexpr,
    ORDER: tl.constexpr,
    order,
):
    """dk, dv and the score gradients (stored where ``STORE_DS``) of a block of keys; dv and the score
    gradients only where not ``DK`` (``_hstu_bwd_dk_stored`` then makes dk from them). Where ``U_GRAD`` is given,
    the program also copies U's gradient of its keys' rows and head into ``dU`` (its columns of the projection's
    gradient), where a copy kernel would make a pass of its own."""
    seq, head, rank = _program(ORDER, order)
    if _is_tail(seq, ORDER):
        if DK:
            _zero_tail(
                dK + head * stride_dkh, offsets, tokens, stride_dkn, ATTENTION_DIM, BLOCK_A, BLOCK_N, ORDER, order
            )
        _zero_tail(dV + head * stride_dvh, offsets, tokens, stride_dvn, HIDDEN_DIM, BLOCK_D, BLOCK_N, ORDER, order)
        if U_GRAD is not None:
            _write_tail(
                dU + head * stride_duh,
                U_GRAD + head * stride_guh,
                offsets,
                tokens,
                stride_dun,
                stride_gun,
                HIDDEN_DIM,
                BLOCK_D,
                BLOCK_N,
                ORDER,
                order,
            )
        return
    start, n = _sequence(offsets, seq)
    block = tl.cdiv(n, BLOCK_N) - _ranks(ORDER) + rank  # the first keys (most rows) first
    if block < 0:
        return
    first = block * BLOCK_N
    ts = timestamps + start
    cols = first + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    if U_GRAD is not None:
        u_grad = _rows(U_GRAD + start * stride_gun + head * stride_guh, cols, col_ok, stride_gun, HIDDEN_DIM, BLOCK_D)
        _store_rows(dU + start * stride_dun + head * stride_duh, cols, col_ok, stride_dun, u_grad, HIDDEN_DIM, BLOCK_D)
    k = _rows(K + start * stride_kn + head * stride_kh, cols, col_ok, stride_kn, ATTENTION_DIM, BLOCK_A)
    v = _rows(V + start * stride_vn + head * stride_vh, cols, col_ok, stride_vn, HIDDEN_DIM, BLOCK_D)
    ts_j = tl.load(ts + cols, mask=col_ok, other=0)
    ranges += 2 * seq * range_blocks
    tj_min, tj_max = _time_range(ranges, first, BLOCK_N, RANGE_BLOCK)
    inv_n = 1.0 / n.to(tl.float32)
    if DK:
        dk = tl.zeros([BLOCK_N, BLOCK_A], dtype=tl.float32)
    else:  # nothing to carry
        dk = tl.zeros([1, 1], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dtime = tl.zeros([TIME_BLOCK], dtype=tl.float32)  # the time table's gradient from this program's tiles
    ds_row = _ds_row(ds_side, ds_head_rows, start, seq, head, STORE_DS)
    low = (first // BLOCK_M) * BLOCK_M
    unmasked = tl.cdiv(first + BLOCK_N, BLOCK_M) * BLOCK_M  # query blocks from here on are past the diagonal
    for row in range(low, tl.minimum(unmasked, n), BLOCK_M):
        dk, dv, dtime = _dkdv_tile(
            dk,
            dv,
            dtime,
            k,
            v,
            ts_j,
            cols,
            row,
            first,
            Q,
            dOut,
            start.to(tl.int32),
            head,
            ts,
            ranges,
            tj_min,
            tj_max,
            d_position,
            position_table,
            time_table,
            n,
            inv_n,
            num_positions,
            num_buckets,
            ATTENTION_DIM,
            HIDDEN_DIM,
            BLOCK_A,
            BLOCK_D,
            True,
            PRECISION,
            FAST,
            CLAMP,
            BIAS_GRADS,
            BLOCK_M,
            BLOCK_N,
            SKEW,
            TIME_BLOCK,
            RANGE_BLOCK,
            DS,
            ds_row,
            STORE_DS,
            SCORES_STORED,
            DK,
        )
    for row in range(unmasked, n, BLOCK_M):
        dk, dv, dtime = _dkdv_tile(
            dk,
            dv,
            dtime,
            k,
            v,
            ts_j,
            cols,
            row,
            first,
            Q,
            dOut,
            start.to(tl.int32),
            head,
            ts,
            ranges,
            tj_min,
            tj_max,
            d_position,
            position_table,
            time_table,
            n,
            inv_n,
            num_positions,
            num_buckets,
            ATTENTION_DIM,
            HIDDEN_DIM,
            BLOCK_A,
            BLOCK_D,
            False,
            PRECISION,
            FAST,
            CLAMP,
            BIAS_GRADS,
            BLOCK_M,
            BLOCK_N,
            SKEW,
            TIME_BLOCK,
            RANGE_BLOCK,
            DS,
            ds_row,
            STORE_DS,
            SCORES_STORED,
            DK,
        )
    if DK:
        offset = start * stride_dkn + head * stride_dkh
        _store_grad_rows(dK, PK, offset, cols, col_ok, stride_dkn, dk * inv_n, ATTENTION_DIM, BLOCK_A)
    offset = start * stride_dvn + head * stride_dvh
    _store_grad_rows(dV, PV, offset, cols, col_ok, stride_dvn, dv * inv_n, HIDDEN_DIM, BLOCK_D)
    if BIAS_GRADS:
        _add_time_grads(d_time, dtime, inv_n, num_buckets, TIME_BLOCK)


@triton.jit
def _dq_tile(
    dq,
    dtime,
    q,
    do,
    ts_i,
    rows,
    first,
    key,
    K,
    V,
    start,
    head,
    ts,
    ranges,
    ti_min,
    ti_max,
    d_position,
    position_table,
    time_table,
    n,
    inv_n,
    num_positions,
    num_buckets,
    ATTENTION_DIM: tl.constexpr,
    HIDDEN_DIM: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    PRECISION: tl.constexpr,
    FAST: tl.constexpr,
    CLAMP: tl.constexpr,
    BIAS_GRADS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SKEW: tl.constexpr,
    TIME_BLOCK: tl.constexpr,
    RANGE_BLOCK: tl.constexpr,
):
    cols = key + tl.arange(0, BLOCK_N)  # keys and values by TMA: rows past the sequence's end are masked below
    k = tl.reshape(K.load([start + key, head, 0]), [BLOCK_N, BLOCK_A])
    v = tl.reshape(V.load([start + key, head, 0]), [BLOCK_N, BLOCK_D])
    tj_min, tj_max = _time_range(ranges, key, BLOCK_N, RANGE_BLOCK)
    _, dsilu, bucket, low, high, _ = _query_tile(
        q,
        k,
        ts_i,
        first,
        key,
        ts,
        tj_min,
        tj_max,
        ti_min,
        ti_max,
        position_table,
        time_table,
        n,
        num_positions,
        num_buckets,
        MASKED,
        PRECISION,
        FAST,
        CLAMP,
        BLOCK_M,
        BLOCK_N,
    )
    ds = tl.dot(do, tl.trans(v), input_precision=PRECISION) * dsilu
    if MASKED:
        ds = tl.where(rows[:, None] >= cols[None, :], ds, 0.0)
    if BIAS_GRADS:
        dtime = _bias_grads(
            ds,
            bucket,
            low,
            high,
            first - key,
            d_position,
            dtime,
            inv_n,
            num_positions,
            False,
            BLOCK_M,
            BLOCK_N,
            SKEW,
            TIME_BLOCK,
            True,
        )
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=PRECISION), dtime


@triton.jit(do_not_specialize=["tokens"])
def _hstu_bwd_dq(
    Q,
    K,
    V,
    dOut,
    dQ,
    PQ,
    d_position,
    d_time,
    offsets,
    tokens,
    timestamps,
    ranges,
    range_blocks,
    position_table,
    time_table,
    stride_qn,
    stride_qh,
    stride_don,
    stride_doh,
    stride_dqn,
    stride_dqh,
    num_positions,
    num_buckets,
    ATTENTION_DIM: tl.constexpr,
    HIDDEN_DIM: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    FAST: tl.constexpr,
    CLAMP: tl.constexpr,
    BIAS_GRADS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SKEW: tl.constexpr,
    TIME_BLOCK: tl.constexpr,
    RANGE_BLOCK: tl.constexpr,
    ORDER: tl.constexpr,
    order,
):
    seq, head, rank = _program(ORDER, order)
    block = _ranks(ORDER) - 1 - rank  # the last rows (most keys) first
    if _is_tail(seq, ORDER):
        _zero_tail(dQ + head * stride_dqh, offsets, tokens, stride_dqn, ATTENTION_DIM, BLOCK_A, BLOCK_M, ORDER, order)
        return
    start, n = _sequence(offsets, seq)
    first = block * BLOCK_M
    if first >= n:
        return
    ts = timestamps + start
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    q = _rows(Q + start * stride_qn + head * stride_qh, rows, row_ok, stride_qn, ATTENTION_DIM, BLOCK_A)
    do = _rows(dOut + start * stride_don + head * stride_doh, rows, row_ok, stride_don, HIDDEN_DIM, BLOCK_D)
    ts_i = tl.load(ts + rows, mask=row_ok, other=0)
    ranges += 2 * seq * range_blocks
    ti_min, ti_max = _time_range(ranges, first, BLOCK_M, RANGE_BLOCK)
    dq = tl.zeros([BLOCK_M, BLOCK_A], dtype=tl.float32)
    dtime = tl.zeros([TIME_BLOCK], dtype=tl.float32)
    inv_n = 1.0 / n.to(tl.float32)
    for key in range(0, first, BLOCK_N):
        dq, dtime = _dq_tile(
            dq,
            dtime,
            q,
            do,
            ts_i,
            rows,
            first,
            key,
            K,
            V,
            start.to(tl.int32),
            head,
            ts,
            ranges,
            ti_min,
            ti_max,
            d_position,
            position_table,
            time_table,
            n,
            inv_n,
            num_positions,
            num_buckets,
            ATTENTION_DIM,
            HIDDEN_DIM,
            BLOCK_A,
            BLOCK_D,
            False,
            PRECISION,
            FAST,
            CLAMP,
            BIAS_GRADS,
            BLOCK_M,
            BLOCK_N,
            SKEW,
            TIME_BLOCK,
            RANGE_BLOCK,
        )
    for key in range(first, tl.minimum(first + BLOCK_M, n), BLOCK_N):
        dq, dtime = _dq_tile(
            dq,
            dtime,
            q,
            do,
            ts_i,
            rows,
            first,
            key,
            K,
            V,
            start.to(tl.int32),
            head,
            ts,
            ranges,
            ti_min,
            ti_max,
            d_position,
            position_table,
            time_table,
            n,
            inv_n,
            num_positions,
            num_buckets,
            ATTENTION_DIM,
            HIDDEN_DIM,
            BLOCK_A,
            BLOCK_D,
            True,
            PRECISION,
            FAST,
            CLAMP,
            BIAS_GRADS,
            BLOCK_M,
            BLOCK_N,
            SKEW,
            TIME_BLOCK,
            RANGE_BLOCK,
        )
    offset = start * stride_dqn + head * stride_dqh
    _store_grad_rows(dQ, PQ, offset, rows, row_ok, stride_dqn, dq * inv_n, ATTENTION_DIM, BLOCK_A)
    if BIAS_GRADS:
        _add_time_grads(d_time, dtime, inv_n, num_buckets, TIME_BLOCK)


@triton.jit
def _ds_row(ds_side, ds_head_rows, start, seq, head, STORE_DS: tl.constexpr):
    """The first row of a sequence's and head's keys in the stored score gradients: ``start + seq x ds_side``
    within each head's ``ds_head_rows`` rows (``_ds_rows``)."""
    if STORE_DS:
        return head * ds_head_rows + (start + seq * ds_side).to(tl.int32)
    else:
        return 0


@triton.jit
def _buckets(ts_known, ts_pointers, low, high, num_buckets, FAST: tl.constexpr):
    """Each pair's time bucket of a tile whose bucket range is ``low..high`` (``_bias``'s, without the tables)."""
    if low == high:
        bucket = tl.full(ts_pointers.shape, 0, tl.int32) + low
    else:
        bucket = _bucket(ts_known - _read(ts_pointers, FAST), num_buckets)
    return bucket


@triton.jit
def _dq_stored_tile(
    dq,
    dtime,
    DS,
    ds_row,
    ts_i,
    rows,
    row_ok,
    first,
    key,
    K,
    start,
    head,
    ts,
    ranges,
    ti_min,
    ti_max,
    d_position,
    n,
    inv_n,
    num_positions,
    num_buckets,
    BLOCK_A: tl.constexpr,
    MASKED: tl.constexpr,
    LAST: tl.constexpr,
    PRECISION: tl.constexpr,
    FAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SKEW: tl.constexpr,
    TIME_BLOCK: tl.constexpr,
    RANGE_BLOCK: tl.constexpr,
    POSITIONS: tl.constexpr,
    TIME: tl.constexpr,
):
    """One [queries, keys] tile of dq from the score gradients the dk/dv kernel stored (keys by queries), and
    its bias gradients (the position table's unless not ``POSITIONS``; none unless ``TIME``). Entries the
    dk/dv kernel did not write (past the diagonal or the sequence's end, of tiles it did not visit) are masked
    here."""
    cols = key + tl.arange(0, BLOCK_N)
    ds = tl.trans(DS.load([ds_row + key, first])).to(tl.float32)
    if MASKED:
        ds = tl.where((rows[:, None] >= cols[None, :]) & row_ok[:, None], ds, 0.0)
    elif LAST:
        ds = tl.where(row_ok[:, None], ds, 0.0)
    if TIME:
        tj_min, tj_max = _time_range(ranges, key, BLOCK_N, RANGE_BLOCK)
        low, high = _bucket_range(ti_min, ti_max, tj_min, tj_max, num_buckets)
        bucket = _buckets(
            ts_i[:, None],
            tl.broadcast_to((ts + tl.minimum(cols, n - 1))[None, :], (BLOCK_M, BLOCK_N)),
            low,
            high,
            num_buckets,
            FAST,
        )
        dtime = _bias_grads(
            ds,
            bucket,
            low,
            high,
            first - key,
            d_position,
            dtime,
            inv_n,
            num_positions,
            False,
            BLOCK_M,
            BLOCK_N,
            SKEW,
            TIME_BLOCK,
            POSITIONS,
        )
    k = tl.reshape(K.load([start + key, head, 0]), [BLOCK_N, BLOCK_A])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=PRECISION), dtime


@triton.jit(do_not_specialize=["tokens", "ds_head_rows"])
def _hstu_bwd_dq_stored(
    DS,
    ds_side,
    ds_head_rows,
    K,
    dQ,
    PQ,
    d_position,
    d_time,
    offsets,
    tokens,
    timestamps,
    ranges,
    range_blocks,
    stride_dqn,
    stride_dqh,
    num_positions,
    num_buckets,
    ATTENTION_DIM: tl.constexpr,
    BLOCK_A: tl.constexpr,
    PRECISION: tl.constexpr,
    FAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SKEW: tl.constexpr,
    TIME_BLOCK: tl.constexpr,
    RANGE_BLOCK: tl.constexpr,
    POSITIONS: tl.constexpr,
    TIME: tl.constexpr,
    ORDER: tl.constexpr,
    order,
):
    """dq and the bias gradients from the stored score gradients: one product per tile where ``_hstu_bwd_dq``
    recomputes the scores and dP (two more). The position table's gradient only if ``POSITIONS`` (else
    ``_hstu_bwd_position_bands`` sums it), the time table's only if ``TIME`` (else the dk kernel or
    ``_hstu_bwd_time_stored``)."""
    seq, head, rank = _program(ORDER, order)
    block = _ranks(ORDER) - 1 - rank  # the last rows (most keys) first
    if _is_tail(seq, ORDER):
        _zero_tail(dQ + head * stride_dqh, offsets, tokens, stride_dqn, ATTENTION_DIM, BLOCK_A, BLOCK_M, ORDER, order)
        return
    start, n = _sequence(offsets, seq)
    first = block * BLOCK_M
    if first >= n:
        return
    ds_row = _ds_row(ds_side, ds_head_rows, start, seq, head, True)
    ts = timestamps + start
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    ts_i = tl.load(ts + rows, mask=row_ok, other=0)
    ranges += 2 * seq * range_blocks
    ti_min, ti_max = _time_range(ranges, first, BLOCK_M, RANGE_BLOCK)
    dq = tl.zeros([BLOCK_M, BLOCK_A], dtype=tl.float32)
    dtime = tl.zeros([TIME_BLOCK], dtype=tl.float32)
    inv_n = 1.0 / n.to(tl.float32)
    if first + BLOCK_M > n:  # the sequence's last block of queries: rows past its end are masked
        for key in range(0, first, BLOCK_N):
            dq, dtime = _dq_stored_tile(
                dq,
                dtime,
                DS,
                ds_row,
                ts_i,
                rows,
                row_ok,
                first,
                key,
                K,
                start.to(tl.int32),
                head,
                ts,
                ranges,
                ti_min,
                ti_max,
                d_position,
                n,
                inv_n,
                num_positions,
                num_buckets,
                BLOCK_A,
                False,
                True,
                PRECISION,
                FAST,
                BLOCK_M,
                BLOCK_N,
                SKEW,
                TIME_BLOCK,
                RANGE_BLOCK,
                POSITIONS,
                TIME,
            )
    else:
        for key in range(0, first, BLOCK_N):
            dq, dtime = _dq_stored_tile(
                dq,
                dtime,
                DS,
                ds_row,
                ts_i,
                rows,
                row_ok,
                first,
                key,
                K,
                start.to(tl.int32),
                head,
                ts,
                ranges,
                ti_min,
                ti_max,
                d_position,
                n,
                inv_n,
                num_positions,
                num_buckets,
                BLOCK_A,
                False,
                False,
                PRECISION,
                FAST,
                BLOCK_M,
                BLOCK_N,
                SKEW,
                TIME_BLOCK,
                RANGE_BLOCK,
                POSITIONS,
                TIME,
            )
    for key in range(first, tl.minimum(first + BLOCK_M, n), BLOCK_N):
        dq, dtime = _dq_stored_tile(
            dq,
            dtime,
            DS,
            ds_row,
            ts_i,
            rows,
            row_ok,
            first,
            key,
            K,
            start.to(tl.int32),
            head,
            ts,
            ranges,
            ti_min,
            ti_max,
            d_position,
            n,
            inv_n,
            num_positions,
            num_buckets,
            BLOCK_A,
            True,
            False,
            PRECISION,
            FAST,
            BLOCK_M,
            BLOCK_N,
            SKEW,
            TIME_BLOCK,
            RANGE_BLOCK,
            POSITIONS,
            TIME,
        )
    offset = start * stride_dqn + head * stride_dqh
    _store_grad_rows(dQ, PQ, offset, rows, row_ok, stride_dqn, dq * inv_n, ATTENTION_DIM, BLOCK_A)
    if TIME:
        _add_time_grads(d_time, dtime, inv_n, num_buckets, TIME_BLOCK)


@triton.jit
def _time_tile_sums(
    dtime,
    ds,
    row,
    n,
    ts,
    ts_j,
    ranges,
    tj_min,
    tj_max,
    num_buckets,
    BLOCK_M: tl.constexpr,
    TIME_BLOCK: tl.constexpr,
    RANGE_BLOCK: tl.constexpr,
):
    """Adds to ``dtime`` the sums per time bucket of a [keys, queries] tile ``ds`` (fp32, zero where no pair),
    by ``_bias_grads`` (no position sums): the tile's sum where its gaps share one bucket (from the blocks'
    time ranges), else each pair's bucket from the two blocks' times (the keys' ``ts_j`` in registers) and
    one sum per bucket of the range."""
    ti_min, ti_max = _time_range(ranges, row, BLOCK_M, RANGE_BLOCK)
    low, high = _bucket_range(ti_min, ti_max, tj_min, tj_max, num_buckets)
    if low == high:
        bucket = tl.full(ds.shape, 0, tl.int32) + low
    else:
        ts_i = tl.load(ts + tl.minimum(row + tl.arange(0, BLOCK_M), n - 1))
        bucket = _bucket(ts_i[None, :] - ts_j[:, None], num_buckets)
    BLOCK_N: tl.constexpr = ds.shape[0]
    return _bias_grads(ds, bucket, low, high, 0, None, dtime, 1.0, 1, True, BLOCK_M, BLOCK_N, 1, TIME_BLOCK, False)


@triton.jit
def _keys_stored_tile(
    dk,
    dtime,
    DS,
    ds_row,
    first,
    row,
    n,
    Q,
    start,
    head,
    ts,
    ts_j,
    ranges,
    tj_min,
    tj_max,
    num_buckets,
    BLOCK_A: tl.constexpr,
    MASK: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DK: tl.constexpr,
    TIME: tl.constexpr,
    TIME_BLOCK: tl.constexpr,
    RANGE_BLOCK: tl.constexpr,
):
    """One [keys, queries] tile of the stored score gradients: its product with the queries into dk (if
    ``DK``) and its sums per time bucket (if ``TIME``). ``MASK``: a tile on the diagonal or past the
    sequence's end, whose entries the dk/dv kernel may not have written (its tiles can be smaller)."""
    ds = DS.load([ds_row + first, row])
    rows = row + tl.arange(0, BLOCK_M)
    if MASK:
        ds = tl.where((rows[None, :] >= first + tl.arange(0, BLOCK_N)[:, None]) & (rows[None, :] < n), ds, 0.0)
        ds = ds.to(DS.dtype)
    if DK:
        q = tl.reshape(Q.load([start + row, head, 0]), [BLOCK_M, BLOCK_A])
        dk += tl.dot(ds, q, input_precision=PRECISION)
    if TIME:
        dtime = _time_tile_sums(
            dtime,
            ds.to(tl.float32),
            row,
            n,
            ts,
            ts_j,
            ranges,
            tj_min,
            tj_max,
            num_buckets,
            BLOCK_M,
            TIME_BLOCK,
            RANGE_BLOCK,
        )
    return dk, dtime


@triton.jit
def _keys_stored(
    DS,
    ds_side,
    ds_head_rows,
    Q,
    dK,
    PK,
    d_time,
    offsets,
    tokens,
    timestamps,
    ranges,
    range_blocks,
    stride_dkn,
    stride_dkh,
    num_buckets,
    ATTENTION_DIM: tl.constexpr,
    BLOCK_A: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DK: tl.constexpr,
    TIME: tl.constexpr,
    TIME_BLOCK: tl.constexpr,
    RANGE_BLOCK: tl.constexpr,
    ORDER: tl.constexpr,
    order,
    LOOP_STAGES: tl.constexpr = None,
):
    """One block of keys of ``_hstu_bwd_dk_stored`` (``DK``) or ``_hstu_bwd_time_stored`` (not ``DK``): its
    tiles of the stored score gradients (``DS``, [keys, queries]) with the queries from the diagonal on, each
    multiplied into dk's one accumulator (if ``DK``; the dk/dv kernel would hold two) and summed per time
    bucket (if ``TIME``). ``LOOP_STAGES`` pipelines the loops over query blocks that deep; None leaves them
    to the launch's ``num_stages``, which pipelines the loads that feed a dot product (dk's) only."""
    seq, head, rank = _program(ORDER, order)
    if _is_tail(seq, ORDER):
        if DK:
            _zero_tail(
                dK + head * stride_dkh, offsets, tokens, stride_dkn, ATTENTION_DIM, BLOCK_A, BLOCK_N, ORDER, order
            )
        return
    start, n = _sequence(offsets, seq)
    block = tl.cdiv(n, BLOCK_N) - _ranks(ORDER) + rank  # the first keys (most rows) first
    if block < 0:
        return
    first = block * BLOCK_N
    ds_row = _ds_row(ds_side, ds_head_rows, start, seq, head, True)
    start32 = start.to(tl.int32)
    cols = first + tl.arange(0, BLOCK_N)
    ts = timestamps + start
    ranges += 2 * seq * range_blocks
    if TIME:
        ts_j = tl.load(ts + tl.minimum(cols, n - 1))
        tj_min, tj_max = _time_range(ranges, first, BLOCK_N, RANGE_BLOCK)
    else:
        ts_j, tj_min, tj_max = 0, 0, 0
    if DK:
        dk = tl.zeros([BLOCK_N, BLOCK_A], dtype=tl.float32)
    else:  # nothing to carry
        dk = tl.zeros([1, 1], dtype=tl.float32)
    dtime = tl.zeros([TIME_BLOCK], dtype=tl.float32)
    unmasked = tl.cdiv(first + BLOCK_N, BLOCK_M) * BLOCK_M  # query blocks from here on are past the diagonal
    full = (n // BLOCK_M) * BLOCK_M  # where the last, partial block of queries starts
    for row in tl.range((first // BLOCK_M) * BLOCK_M, tl.minimum(unmasked, n), BLOCK_M, num_stages=LOOP_STAGES):
        dk, dtime = _keys_stored_tile(
            dk, dtime, DS, ds_row, first, row, n, Q, start32, head,
            ts, ts_j, ranges, tj_min, tj_max, num_buckets,
            BLOCK_A, True, PRECISION, BLOCK_M, BLOCK_N, DK, TIME, TIME_BLOCK, RANGE_BLOCK,
        )  # fmt: skip
    for row in tl.range(unmasked, full, BLOCK_M, num_stages=LOOP_STAGES):
        dk, dtime = _keys_stored_tile(
            dk, dtime, DS, ds_row, first, row, n, Q, start32, head,
            ts, ts_j, ranges, tj_min, tj_max, num_buckets,
            BLOCK_A, False, PRECISION, BLOCK_M, BLOCK_N, DK, TIME, TIME_BLOCK, RANGE_BLOCK,
        )  # fmt: skip
    if (full >= unmasked) & (full < n):  # the last, partial block of queries
        dk, dtime = _keys_stored_tile(
            dk, dtime, DS, ds_row, first, full, n, Q, start32, head,
            ts, ts_j, ranges, tj_min, tj_max, num_buckets,
            BLOCK_A, True, PRECISION, BLOCK_M, BLOCK_N, DK, TIME, TIME_BLOCK, RANGE_BLOCK,
        )  # fmt: skip
    inv_n = 1.0 / n.to(tl.float32)
    if DK:
        offset = start * stride_dkn + head * stride_dkh
        _store_grad_rows(dK, PK, offset, cols, cols < n, stride_dkn, dk * inv_n, ATTENTION_DIM, BLOCK_A)
    if TIME:
        _add_time_grads(d_time, dtime, inv_n, num_buckets, TIME_BLOCK)


@triton.jit(do_not_specialize=["tokens", "ds_head_rows"])
def _hstu_bwd_dk_stored(
    DS,
    ds_side,
    ds_head_rows,
    Q,
    dK,
    PK,
    d_time,
    offsets,
    tokens,
    timestamps,
    ranges,
    range_blocks,
    stride_dkn,
    stride_dkh,
    num_buckets,
    ATTENTION_DIM: tl.constexpr,
    BLOCK_A: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TIME: tl.constexpr,
    TIME_BLOCK: tl.constexpr,
    RANGE_BLOCK: tl.constexpr,
    ORDER: tl.constexpr,
    order,
):
    """dk from the stored score gradients, and the time table's gradient too if ``TIME`` (``_keys_stored``)."""
    _keys_stored(
        DS, ds_side, ds_head_rows, Q, dK, PK, d_time, offsets, tokens, timestamps, ranges, range_blocks,
        stride_dkn, stride_dkh, num_buckets, ATTENTION_DIM, BLOCK_A, PRECISION, BLOCK_M, BLOCK_N,
        True, TIME, TIME_BLOCK, RANGE_BLOCK, ORDER, order,
    )  # fmt: skip


@triton.jit(do_not_specialize=["tokens", "ds_head_rows"])
def _hstu_bwd_time_stored(
    DS,
    ds_side,
    ds_head_rows,
    d_time,
    offsets,
    tokens,
    timestamps,
    ranges,
    range_blocks,
    num_buckets,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TIME_BLOCK: tl.constexpr,
    RANGE_BLOCK: tl.constexpr,
    ORDER: tl.constexpr,
    order,
):
    """The time table's gradient from the stored score gradients, a pass of its own (``_keys_stored``)."""
    _keys_stored(
        DS, ds_side, ds_head_rows, None, None, None, d_time, offsets, tokens, timestamps, ranges, range_blocks,
        0, 0, num_buckets, 1, 1, "ieee", BLOCK_M, BLOCK_N,
        False, True, TIME_BLOCK, RANGE_BLOCK, ORDER, order, _SUMS_LOOP_STAGES,
    )  # fmt: skip


@triton.jit(do_not_specialize=["ds_head_rows"])
def _hstu_bwd_position_bands(
    DS,
    ds_side,
    ds_head_rows,
    d_position,
    offsets,
    max_len,
    num_positions,
    bands,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """The position table's gradient from the stored score gradients, by bands of tiles: program (band,
    chunk, sequence, head) adds up elementwise the [keys, queries] tiles of key block ``kb`` and query block
    ``kb + band`` for the chunk's ``CHUNK`` key blocks (square tiles, BLOCK_M == BLOCK_N: entry (c, r) of
    each is at distance band x BLOCK_M + r - c), then sums the accumulator's diagonals once and adds them
    atomically: a pass over the causal score gradients at memory speed, where the dq kernel would rotate and
    add every tile. Chunks keep the longest bands from setting the kernel's time."""
    band, chunk = tl.program_id(0) % bands, tl.program_id(0) // bands
    seq, head = tl.program_id(1), tl.program_id(2)
    start, n = _sequence(offsets, seq)
    first = band * BLOCK_M
    stored = tl.minimum(n, max_len)  # the keys the buffer holds
    low = chunk * CHUNK * BLOCK_N
    if first + low >= stored:
        return
    ds_row = _ds_row(ds_side, ds_head_rows, start, seq, head, True)
    keys = tl.arange(0, BLOCK_N)[:, None]
    queries = tl.arange(0, BLOCK_M)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for key in tl.range(low, tl.minimum(stored - first, low + CHUNK * BLOCK_N), BLOCK_N, num_stages=_SUMS_LOOP_STAGES):
        tile = DS.load([ds_row + key, first + key]).to(tl.float32)
        acc += tl.where((first + queries >= keys) & (first + key + queries < stored), tile, 0.0)
    _position_grads(tl.trans(acc), first, d_position, 1.0 / n.to(tl.float32), num_positions, BLOCK_M, BLOCK_N)


def kernel_configs(block_a: int, block_d: int, dtype: torch.dtype, device: torch.device) -> dict[str, dict]:
    """Launch settings per kernel, which backward kernel sums the bias gradients, and whether the dk/dv
    kernel stores the score gradients for the dq kernel (``store_ds``; ``dq`` then launches
    ``_hstu_bwd_dq_stored``) and, if so, whether the position table's gradient is summed from them by bands
    of square tiles (``bands``: ``_hstu_bwd_position_bands``'s settings, ``CHUNK`` tiles of a band per
    program; absent or None: in the dq kernel). On CUDA, the fastest of the candidates timed on an H200 for
    heads of 128 and of 256 in bf16 (``benchmarks/hstu_attention_kernel.py --sweep`` and the comparisons in
    BENCHMARKS.md): both store the score gradients and sum the positions by bands; smaller tiles for fp32,
    whose tiles take twice the shared memory, and the scores recomputed. ``ORDER`` (``_program``; absent:
    "index"): the batch's longest blocks first at heads of 128 in bf16, the longest sequences first at heads
    of 256 in bf16. ``store_s`` (heads of 256 in bf16; needs ``store_ds``): the forward stores the scores and
    the dk/dv kernel reads them (its product and bias not recomputed: 18% faster, the forward 10% slower, for
    a buffer of about heads x tokens x max_len per layer held from forward to backward; its tiles of 32
    queries then hold no spills, 9% faster than 64). ``dk`` (needs ``store_ds``): dk from the stored score
    gradients in a kernel of its own (``_hstu_bwd_dk_stored``, these launch settings), the dk/dv kernel then
    holding dv's accumulator alone (heads of 256 in bf16: the two 33% faster than the dk/dv kernel with
    both; on an H200 its tiles of 64 queries by 128 keys at 8 warps and 3 stages gave a wrong dk, at 2
    stages or 4 warps a right one). ``time`` (needs ``bands``): where the time table's gradient is summed
    from the stored score gradients, None (absent) in the dq kernel, "dk" in the dk kernel, or the launch
    settings of a pass of its own (``_hstu_bwd_time_stored``); the dq kernel then makes dq alone (heads of
    256 in bf16: a pass of its own, and dq's tiles of 64 queries, 12% faster than the two kernels with the
    sums in dq; in the dk kernel, slower). ``sums_beside`` (heads of 256 in bf16, on CUDA): the time pass and the
    position bands run on a stream of the device's own (``_beside``) while the dk and dq kernels run on the
    caller's, which waits for them before the tables' gradients are returned: the two memory-bound passes fill
    what the product-bound kernels leave of the GPU (on an H100, the seed shape's backward 2% faster, queued:
    ``kernel_ab.py --queued``). Small tiles on the CPU (Triton's interpreter: tests only)."""
    if device.type != "cuda":
        tile = dict(BLOCK_M=16, BLOCK_N=16, ORDER="blocks")
        return {"fwd": tile, "dkdv": tile, "dq": tile, "bias_grads": "dq"}
    if max(block_a, block_d) > 128:  # heads of 256 (the seed's shape): accumulators twice as wide
        wide = dict(num_warps=8, num_stages=2)
        if dtype == torch.float32:
            return {
                "fwd": dict(BLOCK_M=32, BLOCK_N=16, **wide),
                "dkdv": dict(BLOCK_M=16, BLOCK_N=32, **wide),
                "dq": dict(BLOCK_M=32, BLOCK_N=16, **wide),
                "bias_grads": "dq",
            }
        return {
            "fwd": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2, ORDER="sequences"),
            "dkdv": dict(BLOCK_M=32, BLOCK_N=64, ORDER="sequences", num_warps=4, num_stages=3),  # dv and ds only
            # dk and dq wait on their tiles of stored score gradients (read from HBM): five and four stages took
            # dk 2-6% and dq 9-13% less time per call than four and three on an H100 (BENCHMARKS.md)
            "dk": dict(BLOCK_M=32, BLOCK_N=128, ORDER="sequences", num_warps=8, num_stages=5),  # from the stored ds
            "time": dict(BLOCK_M=64, BLOCK_N=64, ORDER="sequences", num_warps=4, num_stages=3),  # the time sums
            "dq": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=4, ORDER="sequences"),  # dq alone
            "bias_grads": "dq",
            "store_ds": True,  # dq from the dk/dv kernel's score gradients
            "store_s": True,  # the dk/dv kernel reads the forward's scores
            "bands": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, CHUNK=32),  # the position sums
            "sums_beside": True,  # the time and position sums on a stream of their own, beside dk and dq
        }
    if dtype == torch.float32:
        return {
            "fwd": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
            "dkdv": dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2),
            "dq": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
            "bias_grads": "dq",
        }
    return {
        "fwd": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3, maxnreg=168, ORDER="blocks"),  # 3 per SM
        "dkdv": dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2, ORDER="blocks"),
        "dq": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, ORDER="blocks"),
        "bias_grads": "dq",
        "store_ds": True,  # the backward's attention kernels 20-27% faster than recomputing the scores (BENCHMARKS.md)
        "bands": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, CHUNK=32),
    }


def _launched(configs: dict) -> list[str]:
    """The kernels these launch settings run: the forward, dk/dv and dq kernels always, the dk kernel and the
    time pass where their settings are given (a dict)."""
    return ["fwd", "dkdv", "dq", *(kind for kind in ("dk", "time") if isinstance(configs.get(kind), dict))]


def _checked(configs: dict[str, dict]) -> dict[str, dict]:
    """``configs`` after the checks below, each kernel's settings with its ``ORDER`` (absent: "index")."""
    for kind in _launched(configs):
        configs[kind] = {"ORDER": "index", **configs[kind]}
        if configs[kind]["ORDER"] not in ORDERS:
            raise ValueError(f"{kind}: ORDER must be one of {', '.join(ORDERS)}, got {configs[kind]['ORDER']!r}")
    if configs["bias_grads"] not in ("dkdv", "dq"):
        raise ValueError(
            f"bias_grads must name the kernel that sums the bias gradients (dkdv or dq), got {configs['bias_grads']!r}"
        )
    if configs.get("store_ds") and configs["bias_grads"] != "dq":
        raise ValueError("store_ds: the dq kernel reads the stored score gradients and sums the bias gradients")
    if configs.get("store_s") and not configs.get("store_ds"):
        raise ValueError("store_s: the stored scores are read where the score gradients are stored (store_ds)")
    if configs.get("dk") and not configs.get("store_ds"):
        raise ValueError("dk: the dk kernel reads the stored score gradients (store_ds)")
    if not (configs.get("time") in (None, "dk") or isinstance(configs["time"], dict)):
        raise ValueError(
            f"time: None (the time sums in the dq kernel), 'dk' or a pass's launch settings, got {configs['time']!r}"
        )
    if configs.get("time") is not None and not configs.get("bands"):
        raise ValueError("time: the time sums leave the dq kernel only with the position sums (bands)")
    if configs.get("time") == "dk" and not configs.get("dk"):
        raise ValueError("time: 'dk' sums the time gradients in the dk kernel, and the launch settings name none")
    if configs.get("bands") and not configs.get("store_ds"):
        raise ValueError("bands: the position table's gradient by bands reads the stored score gradients (store_ds)")
    if configs.get("bands") and configs["bands"]["BLOCK_M"] != configs["bands"]["BLOCK_N"]:
        raise ValueError(f"bands: the tiles of a band must be square, got {configs['bands']}")
    for kind in ("fwd", "dq"):  # their unmasked key blocks end where the query block starts
        if configs[kind]["BLOCK_M"] % configs[kind]["BLOCK_N"]:
            raise ValueError(f"{kind}: BLOCK_N must divide BLOCK_M, got {configs[kind]}")
    return configs


def _sizes(q: torch.Tensor, v: torch.Tensor, position: torch.Tensor, time: torch.Tensor, max_len: int) -> dict:
    block_a = max(16, triton.next_power_of_2(q.shape[-1]))
    block_d = max(16, triton.next_power_of_2(v.shape[-1]))
    return dict(
        ATTENTION_DIM=q.shape[-1],
        HIDDEN_DIM=v.shape[-1],
        BLOCK_A=block_a,
        BLOCK_D=block_d,
        num_positions=position.numel(),
        num_buckets=time.numel(),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FAST=q.dtype != torch.float32 and q.is_cuda,  # 16-bit on a GPU: approximate sigmoid, tables read in PTX
        CLAMP=max_len > position.numel(),
    )  # distances can pass the position table's last entry


def _check(q, k, v, offsets, timestamps, position, time):
    if not (q.dim() == k.dim() == v.dim() == 3 and q.shape[:2] == k.shape[:2] == v.shape[:2]):
        raise ValueError(
            f"q, k, v must be [tokens, heads, dim] with equal tokens and heads; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1] or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"q and k need the same width and q, k, v one dtype; got {tuple(q.shape)} {q.dtype}, "
            f"{tuple(k.shape)} {k.dtype}, {tuple(v.shape)} {v.dtype}"
        )
    if timestamps.is_floating_point() or offsets.is_floating_point():
        raise ValueError(
            f"timestamps (seconds) and offsets must be integer tensors, got {timestamps.dtype} and {offsets.dtype}: "
            f"the time ranges that decide a tile's buckets are taken in integers"
        )
    if position.numel() == 0 or time.numel() == 0:
        raise ValueError(f"the bias tables need at least one entry each, got {position.numel()} and {time.numel()}")
    if timestamps.shape != q.shape[:1] or offsets.dim() != 1 or len(offsets) < 2:
        raise ValueError(
            f"timestamps must be [tokens] ({q.shape[0]}) and offsets [sequences + 1]; got "
            f"{tuple(timestamps.shape)} and {tuple(offsets.shape)}"
        )
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v must be contiguous in their last dimension")
    if not (position.is_contiguous() and time.is_contiguous()):
        raise ValueError("the bias tables must be contiguous")


def _tile_sides(configs: dict[str, dict]) -> list[int]:
    return [c[side] for c in configs.values() if isinstance(c, dict) for side in ("BLOCK_M", "BLOCK_N")]


def _ds_rows(offsets: torch.Tensor, tokens: int, heads: int, max_len: int, side: int, dtype) -> tuple:
    """Memory for the score gradients the dk/dv kernel stores, [heads x rows, columns]: per head, each
    sequence's keys (``min(n, max_len)`` of them, rounded up to ``side``) are rows, its queries columns
    (``max_len`` rounded up to ``side``); and the rows per head. Sequence s's keys start at row
    ``offsets[s] + s x side`` (``_ds_row``): its rounded keys end before ``offsets[s + 1] + (s + 1) x side``,
    where the next one's start, so each head takes ``tokens`` plus ``side`` rows per sequence. Nothing is
    computed from the lengths: no kernel launch, no host sync."""
    head_rows = tokens + (len(offsets) - 1) * side
    columns = triton.cdiv(max(max_len, 1), side) * side
    return torch.empty(max(heads * head_rows, 1), columns, dtype=dtype, device=offsets.device), head_rows


def _ds_descriptor(ds: torch.Tensor, config: dict) -> TensorDescriptor:
    """The stored score gradients read and written as [keys, queries] tiles of a kernel's blocks."""
    return TensorDescriptor(ds, list(ds.shape), list(ds.stride()), [config["BLOCK_N"], config["BLOCK_M"]])


def range_block(configs: dict[str, dict]) -> int:
    """The tokens per time range: the kernels' smallest tile side, so that a tile's time range is the min and
    max of one or a few ranges (the kernels' ``RANGE_BLOCK``)."""
    return min(_tile_sides(configs))


def time_ranges(
    timestamps: torch.Tensor, offsets: torch.Tensor, max_len: int, configs: dict[str, dict]
) -> tuple[torch.Tensor, int]:
    """The earliest and latest time of each block of ``range_block(configs)`` tokens of each sequence (one
    small kernel), and that block size. Padded by a tile's worth of blocks past ``max_len``."""
    block = range_block(configs)
    blocks = triton.cdiv(max(max_len, 1), block) + max(_tile_sides(configs)) // block
    ranges = torch.empty(len(offsets) - 1, blocks, 2, dtype=torch.int64, device=timestamps.device)
    _time_ranges[(blocks, len(offsets) - 1)](timestamps, offsets, ranges, blocks, RANGE_BLOCK=block)
    return ranges, block


def _batch_plan(
    timestamps: torch.Tensor, offsets: torch.Tensor, max_len: int, configs: dict, plans: dict | None
) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """The tiles' time ranges, their block size and the sequences' order (``time_ranges``, ``_sequence_order``):
    what the kernels read of the batch's times and lengths, alike in every layer. ``plans``: None, or a dict
    kept for one batch (one ``offsets`` and ``timestamps``) by the caller: the layers after the first then
    reuse the first's (kernels launched once per batch, not once per layer)."""
    key = (range_block(configs), max(_tile_sides(configs)), max_len, _ordered(configs))
    plan = None if plans is None else plans.get(key)
    if plan is None:
        ranges, block = time_ranges(timestamps, offsets, max_len, configs)
        plan = ranges, block, _sequence_order(offsets, configs)
        if plans is not None:
            plans[key] = plan
    return plan


def _grid(max_len: int, block: int, offsets: torch.Tensor, heads: int, config: dict) -> tuple[int, int, int]:
    """The ranks (blocks of the longest sequence), the sequences and one more (the rows after the last
    sequence), and the heads, laid out as ``_program`` reads them for the config's ``ORDER``."""
    ranks, sequences, order = triton.cdiv(max(max_len, 1), block), offsets.shape[0], config["ORDER"]
    if order == "index":
        return ranks, sequences, heads
    return (ranks, heads, sequences) if order == "sequences" else (heads, sequences, ranks)


def _ordered(configs: dict) -> bool:
    """Whether a kernel's ``ORDER`` is "sequences" (reads the sequences' order)."""
    return any(configs[kind]["ORDER"] == "sequences" for kind in _launched(configs))


def _sequence_order(offsets: torch.Tensor, configs: dict) -> torch.Tensor | None:
    """The sequences' indices, longest first, where a kernel's ``ORDER`` is "sequences" (else None)."""
    if not _ordered(configs):
        return None
    return torch.argsort(offsets.diff(), descending=True, stable=True).to(torch.int32)


def _rows_descriptor(t: torch.Tensor, rows: int, width: int) -> TensorDescriptor:
    """A TMA descriptor of a [tokens, heads, dim] tensor that loads ``rows`` tokens of one head, ``width``
    wide (zeros past ``dim``). TMA needs a 16-byte aligned base and strides: a tensor without them is
    copied first, its rows padded with zeros to a multiple of 16 bytes (and a tensor of no tokens stands in
    as one zero token: no program reads it)."""
    size = t.element_size()
    if t.data_ptr() % 16 or any(stride * size % 16 for stride in t.stride()[:-1]) or t.shape[-1] * size % 16:
        t = torch.nn.functional.pad(t, (0, -t.shape[-1] % (16 // size))).contiguous()
    if len(t) == 0:
        t = t.new_zeros((1, *t.shape[1:]))
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [rows, 1, width])


def _sequences(q, offsets, timestamps, ranges, position, time) -> tuple:
    """The arguments all three kernels take after their tensors, in order: the sequences' offsets and token
    count, the times and the tiles' time ranges, and the two bias tables."""
    return offsets, q.shape[0], timestamps, ranges, ranges.shape[1], position, time


def _forward(
    q, k, v, offsets, timestamps, position, time, max_len, grads: bool, plans: dict | None = None
) -> tuple[torch.Tensor, dict]:
    """The forward kernel's output and what the backward needs besides q, k, v and the inputs (``grads``:
    whether a backward may follow; if not, the scores are not stored; ``plans``: ``_batch_plan``'s)."""
    sizes = _sizes(q, v, position, time, max_len)
    configs = _checked(kernel_configs(sizes["BLOCK_A"], sizes["BLOCK_D"], q.dtype, q.device))
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)  # the kernel zeroes the rows after the last sequence
    ranges, range_block, order = _batch_plan(timestamps, offsets, max_len, configs, plans)
    config = configs["fwd"]
    scores, side, head_rows = None, 0, 0
    if grads and configs.get("store_s"):  # the backward's buffer of score gradients, the scores in it first
        side = max(_tile_sides(configs))
        scores, head_rows = _ds_rows(offsets, q.shape[0], q.shape[1], max_len, side, q.dtype)
    _hstu_fwd[_grid(max_len, config["BLOCK_M"], offsets, q.shape[1], config)](
        q,
        _rows_descriptor(k, config["BLOCK_N"], sizes["BLOCK_A"]),
        _rows_descriptor(v, config["BLOCK_N"], sizes["BLOCK_D"]),
        out,
        None if scores is None else _ds_descriptor(scores, config),
        side,
        head_rows,
        *_sequences(q, offsets, timestamps, ranges, position, time),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        **sizes,
        **config,
        RANGE_BLOCK=range_block,
        STORE_S=scores is not None,
        order=order,
    )
    state = dict(max_len=max_len, sizes=sizes, configs=configs, range_block=range_block, ranges=ranges, order=order)
    return out, {**state, "scores": scores, "scores_head_rows": head_rows}


def _backward(state, q, k, v, offsets, timestamps, position, time, grad, dq, dk, dv, pre=None, u_grads=None):
    """Writes dq, dk and dv (tensors of q's, k's and v's shape: views of a wider tensor are fine) and returns
    the two tables' gradients. ``pre``: None, or the pre-activations x whose SiLU q, k and v are (views of
    the strides of dq, dk and dv): then the gradients written are with respect to x. ``u_grads``: None, or
    (U's gradient, where to write it), both of v's shape: the dk/dv kernel copies the one into the other."""
    pq, pk, pv = (None, None, None) if pre is None else pre
    if pre is not None and any(p.stride() != g.stride() for p, g in zip(pre, (dq, dk, dv))):
        raise ValueError("pre: the pre-activations must have the strides of the gradients written beside them")
    do = grad if grad.stride(-1) == 1 else grad.contiguous()
    d_position = torch.zeros(position.shape, dtype=torch.float32, device=q.device)
    d_time = torch.zeros(time.shape, dtype=torch.float32, device=q.device)
    ranges, sizes, configs, max_len = state["ranges"], state["sizes"], state["configs"], state["max_len"]
    common = _sequences(q, offsets, timestamps, ranges, position, time)
    constants = dict(
        **sizes, TIME_BLOCK=max(16, triton.next_power_of_2(time.numel())), RANGE_BLOCK=state["range_block"]
    )
    in_dq = configs["bias_grads"] == "dq"  # which of the two kernels sums the bias gradients
    store = bool(configs.get("store_ds"))
    ds_side = max(_tile_sides(configs)) if store else 0
    scores_stored = state["scores"] is not None
    if scores_stored:  # the forward's scores, overwritten by their gradients (a second backward recomputes them)
        ds, ds_head_rows, state["scores"] = state["scores"], state["scores_head_rows"], None
    elif store:
        ds, ds_head_rows = _ds_rows(offsets, q.shape[0], q.shape[1], max_len, ds_side, q.dtype)
    else:
        ds_head_rows = 0
    config = configs["dkdv"]
    _hstu_bwd_dkdv[_grid(max_len, config["BLOCK_N"], offsets, q.shape[1], config)](
        _rows_descriptor(q, config["BLOCK_M"], sizes["BLOCK_A"]),
        k,
        v,
        _rows_descriptor(do, config["BLOCK_M"], sizes["BLOCK_D"]),
        dk,
        dv,
        pk,
        pv,
        *((None, None) if u_grads is None else u_grads),
        _ds_descriptor(ds, config) if store else None,
        ds_side,
        ds_head_rows,
        d_position,
        d_time,
        *common,
        *(stride for t in (k, v, dk, dv, *(u_grads or (dv, dv))) for stride in t.stride()[:2]),
        **constants,
        **config,
        SKEW=triton.next_power_of_2(config["BLOCK_M"] + config["BLOCK_N"] - 1),
        BIAS_GRADS=not in_dq,
        STORE_DS=store,
        SCORES_STORED=scores_stored,
        DK=not configs.get("dk"),
        order=state["order"],
    )
    time_sums = configs.get("time")  # None: in the dq kernel; "dk": in the dk kernel; else a pass of its own
    side = _sums_stream(configs, q.device)
    with _beside(side):
        if isinstance(time_sums, dict):
            _time_pass(
                time_sums, ds, ds_side, ds_head_rows, d_time, common, offsets, q, max_len, sizes, constants, state
            )
        if store and configs.get("bands"):
            _bands_pass(configs["bands"], ds, ds_side, ds_head_rows, d_position, offsets, q, max_len, sizes)
    if configs.get("dk"):  # from the score gradients just stored
        config = configs["dk"]
        _hstu_bwd_dk_stored[_grid(max_len, config["BLOCK_N"], offsets, q.shape[1], config)](
            _ds_descriptor(ds, config),
            ds_side,
            ds_head_rows,
            _rows_descriptor(q, config["BLOCK_M"], sizes["BLOCK_A"]),
            dk,
            pk,
            d_time,
            *common[:5],
            dk.stride(0),
            dk.stride(1),
            sizes["num_buckets"],
            ATTENTION_DIM=sizes["ATTENTION_DIM"],
            BLOCK_A=sizes["BLOCK_A"],
            PRECISION=sizes["PRECISION"],
            TIME_BLOCK=constants["TIME_BLOCK"],
            RANGE_BLOCK=constants["RANGE_BLOCK"],
            **config,
            TIME=time_sums == "dk",
            order=state["order"],
        )
    config = configs["dq"]
    skew = triton.next_power_of_2(config["BLOCK_M"] + config["BLOCK_N"] - 1)
    if store:
        _hstu_bwd_dq_stored[_grid(max_len, config["BLOCK_M"], offsets, q.shape[1], config)](
            _ds_descriptor(ds, config),
            ds_side,
            ds_head_rows,
            _rows_descriptor(k, config["BLOCK_N"], sizes["BLOCK_A"]),
            dq,
            pq,
            d_position,
            d_time,
            *common[:5],
            dq.stride(0),
            dq.stride(1),
            sizes["num_positions"],
            sizes["num_buckets"],
            ATTENTION_DIM=sizes["ATTENTION_DIM"],
            BLOCK_A=sizes["BLOCK_A"],
            PRECISION=sizes["PRECISION"],
            FAST=sizes["FAST"],
            TIME_BLOCK=constants["TIME_BLOCK"],
            RANGE_BLOCK=constants["RANGE_BLOCK"],
            **config,
            SKEW=skew,
            POSITIONS=not configs.get("bands"),
            TIME=time_sums is None,
            order=state["order"],
        )
    else:
        _hstu_bwd_dq[_grid(max_len, config["BLOCK_M"], offsets, q.shape[1], config)](
            q,
            _rows_descriptor(k, config["BLOCK_N"], sizes["BLOCK_A"]),
            _rows_descriptor(v, config["BLOCK_N"], sizes["BLOCK_D"]),
            do,
            dq,
            pq,
            d_position,
            d_time,
            *common,
            *(stride for t in (q, do, dq) for stride in t.stride()[:2]),
            **constants,
            **config,
            SKEW=skew,
            BIAS_GRADS=in_dq,
            order=state["order"],
        )
    _join(side)
    return d_position.to(position.dtype), d_time.to(time.dtype)


def _time_pass(config, ds, ds_side, ds_head_rows, d_time, common, offsets, q, max_len, sizes, constants, state):
    """The time table's gradient from the stored score gradients (``_hstu_bwd_time_stored``)."""
    _hstu_bwd_time_stored[_grid(max_len, config["BLOCK_N"], offsets, q.shape[1], config)](
        _ds_descriptor(ds, config),
        ds_side,
        ds_head_rows,
        d_time,
        *common[:5],
        sizes["num_buckets"],
        TIME_BLOCK=constants["TIME_BLOCK"],
        RANGE_BLOCK=constants["RANGE_BLOCK"],
        **config,
        order=state["order"],
    )


def _bands_pass(config, ds, ds_side, ds_head_rows, d_position, offsets, q, max_len, sizes):
    """The position table's gradient from the stored score gradients, by bands (``_hstu_bwd_position_bands``)."""
    bands = triton.cdiv(max(max_len, 1), config["BLOCK_M"])
    chunks = triton.cdiv(bands, config["CHUNK"])
    _hstu_bwd_position_bands[(bands * chunks, len(offsets) - 1, q.shape[1])](
        _ds_descriptor(ds, config),
        ds_side,
        ds_head_rows,
        d_position,
        offsets,
        max_len,
        sizes["num_positions"],
        bands,
        **config,
    )


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
"""Per device, the stream on which the bias tables' sum passes run beside the dk and dq kernels."""


def _sums_stream(configs: dict, device: torch.device) -> torch.cuda.Stream | None:
    """The stream of the bias tables' sum passes (``kernel_configs``' ``sums_beside``): the device's own, made
    once, or None: the caller's."""
    if not (configs.get("sums_beside") and device.type == "cuda"):
        return None
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


@contextlib.contextmanager
def _beside(stream: torch.cuda.Stream | None):
    """The launches inside run on ``stream`` (None: on the caller's), after the caller's stream's work so far (the
    stored score gradients), so that the two memory-bound passes run while the dk and dq kernels run on the
    caller's (they read the same score gradients and write other tensors); ``_join`` ends it."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield


def _join(stream: torch.cuda.Stream | None) -> None:
    """The caller's stream waits for ``stream``'s launches (``_beside``)."""
    if stream is not None:
        torch.cuda.current_stream(stream.device).wait_stream(stream)


class _HSTUAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, offsets, timestamps, position, time, max_len, grads):
        out, ctx.state = _forward(q, k, v, offsets, timestamps, position, time, max_len, grads)
        ctx.save_for_backward(q, k, v, offsets, timestamps, position, time)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, offsets, timestamps, position, time = ctx.saved_tensors
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        d_position, d_time = _backward(ctx.state, q, k, v, offsets, timestamps, position, time, grad, dq, dk, dv)
        return dq, dk, dv, None, None, d_position, d_time, None, None


class _ProjectedAttention(torch.autograd.Function):
    """``projected_attention``: one gradient tensor for the projection, its parts written in place."""

    @staticmethod
    def forward(
        ctx,
        x,
        offsets,
        timestamps,
        position,
        time,
        max_len,
        heads,
        attention_dim,
        hidden_dim,
        grads,
        silu,
        silu_u,
        plans,
    ):
        pre = x.contiguous() if silu else None  # the strides of the gradient written beside it
        if silu and not silu_u:  # U stays x's: SiLU of V, Q and K only
            u = _split(pre, heads, attention_dim, hidden_dim)[0]
            activated = _silu_rows(pre[:, heads * hidden_dim :])
            v, q, k = _split(activated, heads, attention_dim, hidden_dim, with_u=False)
        else:
            activated = torch.nn.functional.silu(pre) if silu else x
            u, v, q, k = _split(activated, heads, attention_dim, hidden_dim)
        _check(q, k, v, offsets, timestamps, position, time)
        out, ctx.state = _forward(q, k, v, offsets, timestamps, position, time, max_len, grads, plans)
        ctx.save_for_backward(activated, pre, offsets, timestamps, position, time)
        ctx.dims = heads, attention_dim, hidden_dim
        ctx.silu_u = silu_u
        ctx.width = x.shape[-1]
        return u.flatten(-2), out.flatten(-2)

    @staticmethod
    def backward(ctx, du, grad):
        activated, pre, offsets, timestamps, position, time = ctx.saved_tensors
        v, q, k = _split(activated, *ctx.dims, with_u=activated.shape[-1] == ctx.width)[-3:]
        d_x = torch.empty((activated.shape[0], ctx.width), dtype=activated.dtype, device=activated.device)
        d_u, dv, dq, dk = _split(d_x, *ctx.dims)
        pre_u, pre_v, pre_q, pre_k = (None,) * 4 if pre is None else _split(pre, *ctx.dims)
        u_grads = None
        if du is None:
            d_u.zero_()
        elif pre is None or not ctx.silu_u:  # U's gradient as it came (U not activated here): the dk/dv kernel
            du = du if du.stride(-1) == 1 else du.contiguous()  # copies it into its columns
            u_grads = du.unflatten(-1, d_u.shape[-2:]), d_u
        else:  # U's gradient times SiLU'(x), written into its columns (one kernel)
            torch.ops.aten.silu_backward.grad_input(du, pre_u.flatten(-2), grad_input=d_u.flatten(-2))
        grad = (
            torch.zeros(v.shape, dtype=v.dtype, device=v.device) if grad is None else grad.unflatten(-1, v.shape[-2:])
        )
        pres = None if pre is None else (pre_q, pre_k, pre_v)
        d_position, d_time = _backward(
            ctx.state, q, k, v, offsets, timestamps, position, time, grad, dq, dk, dv, pres, u_grads
        )
        return d_x, None, None, d_position, d_time, None, None, None, None, None, None, None, None


@triton.jit(do_not_specialize=["rows"])
def _silu_rows_kernel(out, x, rows, width, x_stride, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``out = SiLU(x)`` over ``[rows, width]``: ``x``'s rows contiguous, ``out`` contiguous."""
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    mask = (r < rows) & (c < width)
    value = tl.load(x + r * x_stride + c, mask=mask).to(tl.float32)
    activated, _ = _silu(value, False)
    tl.store(out + r * width + c, activated.to(out.dtype.element_ty), mask=mask)


SILU_ROWS_LAUNCH = {"BLOCK_R": 8, "BLOCK_C": 256, "num_warps": 4}
"""``_silu_rows_kernel``'s block of rows and columns per program and its warps (``benchmarks/rows_kernels.py``
times others)."""


def _silu_rows(x: torch.Tensor) -> torch.Tensor:
    """SiLU of ``[N, W]`` ``x`` whose rows are contiguous (a view of some columns of a wider tensor), into a new
    contiguous tensor: torch reads such a view one element at a time, this kernel in blocks of rows."""
    if x.stride(-1) != 1:
        return torch.nn.functional.silu(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows, width = x.shape
    launch = SILU_ROWS_LAUNCH
    grid = (triton.cdiv(rows, launch["BLOCK_R"]), triton.cdiv(width, launch["BLOCK_C"]))
    _silu_rows_kernel[grid](out, x, rows, width, x.stride(0), **launch)
    return out


def _split(uvqk: torch.Tensor, heads: int, attention_dim: int, hidden_dim: int, with_u: bool = True):
    """U, V, Q and K: views ``[N, heads, dim]`` of the projection's ``[N, heads * (2 hidden + 2 attention)]``;
    without ``with_u`` V, Q and K of ``[N, heads * (hidden + 2 attention)]`` (the projection less U)."""
    dims = [hidden_dim] * with_u + [hidden_dim, attention_dim, attention_dim]
    rows, parts = uvqk.shape[0], uvqk.split_with_sizes([heads * d for d in dims], -1)
    return [part.view(rows, heads, dim) for part, dim in zip(parts, dims)]  # not Tensor.split and .unflatten: Python


def _grads(*tensors: torch.Tensor) -> bool:
    """Whether the autograd graph will hold the call (a backward may follow): not under ``torch.no_grad``."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def hstu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    timestamps: torch.Tensor,
    position: torch.Tensor,
    time: torch.Tensor,
    max_len: int,
) -> torch.Tensor:
    """Fused jagged HSTU attention (see the module's docstring): ``q``, ``k`` ``[N, heads, attention_dim]``,
    ``v`` ``[N, heads, hidden_dim]`` (inner dimension contiguous; views of a wider tensor are fine),
    ``offsets`` ``[B + 1]`` (the rows of sequence b are ``offsets[b]:offsets[b + 1]``, non-decreasing, the
    last at most N: not checked here, which would wait for the GPU), ``timestamps``
    ``[N]`` integers (seconds), ``position`` and ``time`` the 1-d bias tables, ``max_len`` at least the
    longest sequence (it sizes the grid; not checked here, which would wait for the GPU: a longer sequence's
    rows past it get no output; ``HSTURecommender`` checks its batches' lengths on the host). Returns
    ``[N, heads, hidden_dim]`` in v's dtype; differentiable in q, k, v and both tables."""
    _check(q, k, v, offsets, timestamps, position, time)
    grads = _grads(q, k, v, position, time)
    return _HSTUAttention.apply(q, k, v, offsets, timestamps, position, time, max_len, grads)


def projected_attention(
    uvqk: torch.Tensor,
    heads: int,
    attention_dim: int,
    hidden_dim: int,
    offsets: torch.Tensor,
    timestamps: torch.Tensor,
    position: torch.Tensor,
    time: torch.Tensor,
    max_len: int,
    silu: bool = False,
    plans: dict | None = None,
    silu_u: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The HSTU layer's attention from its projection: ``uvqk`` ``[N, heads * (2 hidden_dim + 2
    attention_dim)]`` holds U, V, Q and K side by side (in that order, each ``heads`` wide). Returns U
    ``[N, heads * hidden_dim]`` (a view of ``uvqk``) and ``hstu_attention`` of the Q, K and V parts, flattened
    to ``[N, heads * hidden_dim]``. The
    same values and gradients as splitting ``uvqk`` and calling ``hstu_attention``; in backward the
    kernels write dq, dk and dv into their columns of ``uvqk``'s gradient, where the split's backward
    would concatenate four gradient tensors into a new one. With ``silu`` the projection is the layer's
    pre-activations x and U, V, Q and K are SiLU(x) (computed here): the kernels then write the gradients
    with respect to x, SiLU's derivative applied as they store dq, dk and dv (and U's in one kernel), where
    SiLU's own backward would read and write the whole gradient once more. ``plans``: a dict the caller
    keeps for one batch's ``offsets`` and ``timestamps`` and passes to every layer's call, so that what the
    kernels read of the batch's times and lengths (the tiles' time ranges, the sequences' order) is computed
    by the first call only; None computes it at every call. With ``silu`` and not ``silu_u``, U comes back as
    x's (not activated; a view of ``uvqk``) and its gradient is taken as the gradient with respect to x: for a
    caller that applies SiLU to U where it reads it (a compiled gating), so that neither SiLU of U nor its
    derivative makes a pass over memory of its own."""
    width = heads * (2 * hidden_dim + 2 * attention_dim)
    if uvqk.dim() != 2 or uvqk.shape[-1] != width:
        raise ValueError(
            f"uvqk must be [tokens, heads * (2 hidden_dim + 2 attention_dim)] = [N, {width}] for heads={heads}, "
            f"attention_dim={attention_dim}, hidden_dim={hidden_dim}; got {tuple(uvqk.shape)}"
        )
    grads = _grads(uvqk, position, time)
    return _ProjectedAttention.apply(
        uvqk, offsets, timestamps, position, time, max_len, heads, attention_dim, hidden_dim, grads, silu, silu_u, plans
    )
