"""The fused jagged HSTU attention kernel against the padded PyTorch reference: output and every gradient
(q, k, v, both bias tables). On the CPU machine the kernel runs in Triton's interpreter (fp32; the
interpreter does not compute bf16); on a GPU the same checks run on CUDA, and bf16 is checked too.

Tolerances: fp32, relative norm error 1e-5 (the kernel sums in another order than the reference; the
fp32 path uses exact products and an exact sigmoid); bf16, 1e-2 against the fp32 reference on the same
rounded inputs (bf16 operands, fp32 accumulation, an approximate sigmoid)."""

import math

import pytest
import torch

triton = pytest.importorskip("triton")

from lightning_hstu.kernels import hstu_attention as kernel  # noqa: E402
from lightning_hstu.models.hstu_layers import HSTUConfig, PaddedTokens, RelativeBias, time_bucket, to_padded  # noqa: E402

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]  # CPU: the interpreter (conftest.py)


def jagged_batch(lengths, heads, attention_dim, hidden_dim, buckets, device, dtype=torch.float32, seed=0):
    """Random q, k, v and times whose gaps include 0 (the first bucket), gaps at both sides of powers of
    two, and gaps past 2^(buckets - 1) (the last bucket)."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    q, k, v = (
        torch.randn(n, heads, d, generator=gen).to(device, dtype).requires_grad_()
        for d in (attention_dim, attention_dim, hidden_dim)
    )
    gaps = torch.randint(0, 200, (n,), generator=gen)
    gaps[::4] = 0
    gaps[1::9] = 2 ** (buckets + 2)
    gaps[2::7] = 2**6 - 1
    gaps[3::7] = 2**6 - 2
    times = torch.cumsum(gaps, 0).to(device)
    lengths = torch.tensor(lengths, device=device)
    return q, k, v, torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)), times, lengths


def bias_tables(num_positions, buckets, device, seed=1):
    torch.manual_seed(seed)
    bias = RelativeBias(HSTUConfig(max_seq_len=num_positions, time_buckets=buckets)).to(device)
    torch.nn.init.normal_(bias.position)
    torch.nn.init.normal_(bias.time)
    return bias


def reference(q, k, v, lengths, times, bias):
    """The padded plain-PyTorch attention of the HSTU layer, in fp32, back to the jagged rows."""
    qp, mask = to_padded(q.float(), lengths)
    kp, _ = to_padded(k.float(), lengths)
    vp, _ = to_padded(v.float(), lengths)
    tp, _ = to_padded(times, lengths)
    return PaddedTokens(mask, bias.indices(tp)).attend(qp, kp, vp, bias)[mask]


def outputs_and_gradients(attention, q, k, v, bias, grad):
    for t in (q, k, v, *bias.parameters()):
        t.grad = None
    out = attention()
    (out.float() * grad).sum().backward()
    return [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float(), bias.position.grad, bias.time.grad]


def relative_errors(got, expected):
    names = ["out", "dq", "dk", "dv", "dposition", "dtime"]
    return {name: ((g - e).norm() / e.norm()).item() for name, g, e in zip(names, got, expected)}


CASES = {  # lengths, heads, attention_dim, hidden_dim, position entries, buckets, max_len
    "length-1 rows and rows of exactly L": ([1, 40, 17, 1, 33, 40], 2, 16, 32, 40, 8, 40),
    "head widths that are not powers of two": ([5, 23, 1, 30], 2, 24, 20, 30, 6, 30),
    "sequences longer than the position table": ([50, 3, 44], 1, 16, 16, 20, 8, 50),
    "heads of 256 (the seed's shape)": ([1, 70, 33], 2, 256, 256, 70, 8, 70),
    "tiles whose gaps span more buckets than the dq kernel sums at once": ([45, 2, 29], 2, 16, 16, 45, 20, 45),
}


LAUNCHES = {  # launch settings that change how the bias gradients are summed
    "bias gradients in dq": {},
    "bias gradients in dkdv": {"bias_grads": "dkdv"},
    "dq tiles of two key blocks": {"dq": dict(BLOCK_M=32, BLOCK_N=16)},  # the position sums' rotated row blocks
    "score gradients stored": {"store_ds": True},  # dq from the dk/dv kernel's score gradients
    "score gradients stored, dq tiles of two key blocks": {"store_ds": True, "dq": dict(BLOCK_M=32, BLOCK_N=16)},
    "position sums by bands": {
        "store_ds": True,
        "bands": dict(BLOCK_M=16, BLOCK_N=16, CHUNK=2),
    },  # from the stored ones
    # dk by a kernel of its own from the stored score gradients, on tiles other than the dk/dv kernel's
    "dk from the stored score gradients": {
        "store_ds": True,
        "store_s": True,
        "dk": dict(BLOCK_M=32, BLOCK_N=32, ORDER="sequences"),
    },
    # the time table's gradient from the stored score gradients, in the dk kernel or in a pass of its own
    "time sums in the dk kernel": {
        "store_ds": True,
        "store_s": True,
        "bands": dict(BLOCK_M=16, BLOCK_N=16, CHUNK=2),
        "dk": dict(BLOCK_M=16, BLOCK_N=32),
        "time": "dk",
    },
    "time sums in a pass of their own": {
        "store_ds": True,
        "bands": dict(BLOCK_M=16, BLOCK_N=16, CHUNK=2),
        "time": dict(BLOCK_M=32, BLOCK_N=16, ORDER="sequences"),
    },
    # the two sum passes on a stream of their own, beside the dk and dq kernels (on a GPU; one stream elsewhere)
    "bias sums beside dk and dq": {
        "store_ds": True,
        "store_s": True,
        "bands": dict(BLOCK_M=16, BLOCK_N=16, CHUNK=2),
        "dk": dict(BLOCK_M=16, BLOCK_N=32),
        "time": dict(BLOCK_M=32, BLOCK_N=16, ORDER="sequences"),
        "sums_beside": True,
    },
    # the programs' order (the CPU's default: the longest blocks first; a GPU's in fp32: the batch's order);
    # in the longest sequences' order as at heads of 256 in bf16: the forward's scores read by the dk/dv kernel
    **{
        f"programs in {order} order{', score gradients stored' * store}{', scores stored' * scores}": {
            "store_ds": store,
            "store_s": scores,
            **{kind: dict(BLOCK_M=16, BLOCK_N=16, ORDER=order) for kind in ("fwd", "dkdv", "dq")},
        }
        for order, store, scores in [("index", False, False), ("sequences", True, True), ("blocks", True, False)]
    },
}


@pytest.mark.parametrize("launch", list(LAUNCHES))
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_fp32_output_and_every_gradient_equal_the_padded_reference(case, device, launch, monkeypatch):
    """Also with the bias gradients summed by either backward kernel, and with dq tiles of several key
    blocks (launch settings)."""
    configs = kernel.kernel_configs
    monkeypatch.setattr(kernel, "kernel_configs", lambda *a: {**configs(*a), **LAUNCHES[launch]})
    lengths, heads, a, d, positions, buckets, max_len = CASES[case]
    q, k, v, offsets, times, lengths_t = jagged_batch(lengths, heads, a, d, buckets, device)
    bias = bias_tables(positions, buckets, device)
    grad = torch.randn(len(q), heads, d, device=device)
    got = outputs_and_gradients(
        lambda: kernel.hstu_attention(q, k, v, offsets, times, bias.position, bias.time, max_len), q, k, v, bias, grad
    )
    expected = outputs_and_gradients(lambda: reference(q, k, v, lengths_t, times, bias), q, k, v, bias, grad)
    errors = relative_errors(got, expected)
    assert max(errors.values()) < 1e-5, errors


def test_the_data_reaches_the_first_and_the_last_time_bucket():
    """What the equality test relies on: its times put pairs into bucket 0 and into the last (capped) one."""
    lengths, _, _, _, _, buckets, _ = CASES["length-1 rows and rows of exactly L"]
    *_, times, lengths_t = jagged_batch(lengths, 2, 16, 32, buckets, "cpu")
    padded, mask = to_padded(times, lengths_t)
    _, bucket = RelativeBias(HSTUConfig(max_seq_len=40, time_buckets=buckets)).indices(padded)
    pairs = mask[:, :, None] & mask[:, None, :] & torch.ones(40, 40, dtype=torch.bool).tril()
    assert {0, buckets - 1} <= set(bucket[pairs].tolist())


def test_the_data_puts_more_than_eight_time_buckets_in_one_tile():
    """What the many-bucket case relies on: a 16 x 16 tile (the CPU's) whose pairs span more than the eight
    buckets the dq kernel sums per pass, so that it takes several passes."""
    lengths, _, _, _, positions, buckets, _ = CASES[
        "tiles whose gaps span more buckets than the dq kernel sums at once"
    ]
    *_, times, lengths_t = jagged_batch(lengths, 2, 16, 16, buckets, "cpu")
    padded, _ = to_padded(times, lengths_t)
    _, bucket = RelativeBias(HSTUConfig(max_seq_len=positions, time_buckets=buckets)).indices(padded)
    tile = bucket[0, :16, :16][torch.ones(16, 16, dtype=torch.bool).tril()]
    assert tile.max() - tile.min() + 1 > 8


def test_time_buckets_are_exact_at_powers_of_two():
    gaps = torch.tensor([0, 1, 2, 3, *[2**e - 2 for e in range(3, 25)], *[2**e - 1 for e in range(3, 25)]])
    expected = [math.floor(math.log2(g + 1)) for g in gaps.tolist()]
    assert time_bucket(gaps, 64).tolist() == expected
    assert time_bucket(-gaps, 64).tolist() == expected  # |gap|
    assert time_bucket(gaps, 5).max() == 4  # capped at the last bucket


@pytest.mark.parametrize("extra", [5, 40])  # 40: more rows than one pass of the zeroing programs covers
@pytest.mark.parametrize("device", DEVICES)
def test_rows_outside_every_sequence_get_zero_output_and_zero_gradient(device, extra):
    """A static token capacity: rows past offsets[-1] belong to no sequence."""
    q, k, v, offsets, times, _ = jagged_batch([7, 12], 2, 16, 16, 8, device)
    grown = [
        torch.cat([t.detach(), torch.randn(extra, *t.shape[1:], device=device)]).requires_grad_() for t in (q, k, v)
    ]
    times = torch.cat([times, torch.full((extra,), 10**6, device=device)])
    bias = bias_tables(16, 8, device)
    out = kernel.hstu_attention(*grown, offsets, times, bias.position, bias.time, 16)
    out.sum().backward()
    assert out[-extra:].abs().max() == 0
    assert all(t.grad[-extra:].abs().max() == 0 for t in grown)
    alone = kernel.hstu_attention(q, k, v, offsets, times[:-extra], bias.position, bias.time, 16)
    torch.testing.assert_close(out[:-extra], alone)  # and the real rows do not see them


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_of_empty_sequences_gives_no_rows_and_zero_table_gradients(device):
    q, k, v, _, _, _ = jagged_batch([], 2, 16, 16, 8, device)
    bias = bias_tables(16, 8, device)
    offsets = torch.zeros(3, dtype=torch.int64, device=device)  # two sequences, both empty
    out = kernel.hstu_attention(
        q, k, v, offsets, torch.zeros(0, dtype=torch.int64, device=device), bias.position, bias.time, 16
    )
    out.sum().backward()
    assert out.shape == (0, 2, 16) and q.grad.shape == (0, 2, 16)
    assert bias.position.grad.abs().max() == 0 and bias.time.grad.abs().max() == 0


@pytest.mark.parametrize("launch", ["bias gradients in dq", "dk from the stored score gradients"])
@pytest.mark.parametrize(
    "silu, silu_u, a, d", [(False, True, 16, 24), (True, True, 16, 24), (True, True, 128, 128), (True, False, 16, 24)]
)
@pytest.mark.parametrize("device", DEVICES)
def test_the_attention_from_the_projection_equals_the_split_and_the_kernel(
    device, silu, silu_u, a, d, launch, monkeypatch
):
    """``projected_attention`` (the layer's path: one gradient for the projection, Q, K and V's parts
    written in place by the kernels) against splitting the projection and calling ``hstu_attention``: U,
    the output, the projection's gradient (U's part from U's gradient) and both tables' gradients; with
    ``silu``, from the pre-activations x against SiLU(x) split (the gradient with respect to x); without
    ``silu_u``, U is x's own columns (not activated)."""
    configs = kernel.kernel_configs
    monkeypatch.setattr(kernel, "kernel_configs", lambda *a: {**configs(*a), **LAUNCHES[launch]})
    heads = 2
    _, _, _, offsets, times, _ = jagged_batch([9, 1, 14], heads, a, d, 8, device)
    uvqk = torch.randn(len(times) + 3, heads * (2 * d + 2 * a), device=device)  # 3 rows of spare capacity
    bias = bias_tables(16, 8, device)
    grad_u, grad_y = torch.randn(len(uvqk), heads * d, device=device), torch.randn(len(uvqk), heads * d, device=device)
    times = torch.cat([times, torch.full((3,), 10**6, device=times.device)])

    def run(attention):
        x = uvqk.detach().clone().requires_grad_()
        bias.zero_grad()
        u, y = attention(x)
        ((u * grad_u).sum() + (y * grad_y).sum()).backward()
        return [u.detach(), y.detach(), x.grad, bias.position.grad, bias.time.grad]

    def split(x):
        u, v, q, k = (torch.nn.functional.silu(x) if silu else x).split(
            [heads * d, heads * d, heads * a, heads * a], -1
        )
        u = u if silu_u else x[:, : heads * d]
        q, k, v = q.unflatten(-1, (heads, a)), k.unflatten(-1, (heads, a)), v.unflatten(-1, (heads, d))
        return u, kernel.hstu_attention(q, k, v, offsets, times, bias.position, bias.time, 16).flatten(-2)

    def projected(x):
        return kernel.projected_attention(
            x, heads, a, d, offsets, times, bias.position, bias.time, 16, silu, silu_u=silu_u
        )

    for got, expected in zip(run(projected), run(split)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    width = heads * (2 * a + 2 * d)
    with pytest.raises(
        ValueError, match=rf"\[N, {width}\] for heads=2, attention_dim={a}, hidden_dim={d}; got \(27, 150\)"
    ):
        kernel.projected_attention(uvqk[:, :150], heads, a, d, offsets, times, bias.position, bias.time, 16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton compiles kernels on a GPU only")
def test_token_counts_of_any_divisibility_reuse_the_compiled_kernels():
    """The token count (and the stored score gradients' rows per head, which follow it) changes with every
    batch. The kernels take it unspecialised: after a batch of 32 tokens, batches of 33, 25 and 49 (not
    divisible by 16) launch the kernels already compiled, where Triton would compile each kernel again for
    an integer argument of the other divisibility (seconds, in the middle of training)."""
    from triton import knobs

    heads, a, d = 2, 16, 24
    bias = bias_tables(64, 8, "cuda")
    compiled = []

    def step(lengths):
        _, _, _, offsets, times, _ = jagged_batch(lengths, heads, a, d, 8, "cuda")
        x = torch.randn(len(times), heads * (2 * d + 2 * a), device="cuda", requires_grad=True)
        u, y = kernel.projected_attention(
            x, heads, a, d, offsets, times, bias.position, bias.time, 64, True, silu_u=False
        )
        (u.sum() + y.sum()).backward()

    def hook(**kwargs):
        compiled.append(kwargs["repr"].split("[")[0])

    step([16, 16])
    previous, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, hook
    try:
        for lengths in ([16, 17], [9, 16], [20, 21, 8]):
            step(lengths)
    finally:
        knobs.runtime.jit_cache_hook = previous
    assert compiled == []


@pytest.mark.parametrize("launch", ["bias gradients in dq", "dk from the stored score gradients"])
@pytest.mark.parametrize("device", DEVICES)
def test_layers_sharing_a_batch_plan_compute_it_once_and_train_alike(device, launch, monkeypatch):
    """Two layers' attention over one batch with one ``plans`` dict (as ``JaggedTokens`` gives every layer):
    the batch's time ranges computed by the first call only, and outputs and gradients equal to calls that
    each compute their own (bitwise; the bias tables' gradients, which a GPU sums by atomic adds in no fixed
    order, to fp32 rounding there)."""
    configs = kernel.kernel_configs
    monkeypatch.setattr(kernel, "kernel_configs", lambda *a: {**configs(*a), **LAUNCHES[launch]})
    computed = []
    time_ranges = kernel.time_ranges
    monkeypatch.setattr(kernel, "time_ranges", lambda *a: computed.append(1) or time_ranges(*a))
    heads, a, d = 2, 16, 24
    _, _, _, offsets, times, _ = jagged_batch([9, 1, 14, 30], heads, a, d, 8, device)
    gen = torch.Generator().manual_seed(3)
    uvqk = [torch.randn(len(times), heads * (2 * d + 2 * a), generator=gen).to(device) for _ in range(2)]
    biases = [bias_tables(32, 8, device, seed=s) for s in (1, 2)]

    def run(plans_per_call):
        xs = [x.detach().clone().requires_grad_() for x in uvqk]
        for bias in biases:
            bias.zero_grad()
        total, outputs = 0, []
        for x, bias in zip(xs, biases):
            plans = plans_per_call()
            u, y = kernel.projected_attention(x, heads, a, d, offsets, times, bias.position, bias.time, 32, True, plans)
            total = total + (u * u).sum() + (y * torch.arange(y.shape[-1], device=y.device)).sum()
            outputs.append(y.detach())
        total.backward()
        return outputs + [t.grad for t in xs] + [p.grad for bias in biases for p in (bias.position, bias.time)]

    shared = {}
    together = run(lambda: shared)
    assert len(computed) == 1 and len(shared) == 1
    computed.clear()
    alone = run(lambda: None)
    tables = 4  # the bias tables' gradients, last: on a GPU summed by atomic adds, in no fixed order
    for got, expected in zip(together[:-tables], alone[:-tables]):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    rounding = 0.0 if device == "cpu" else 1e-6  # of fp32 sums, as a share of the table's largest entry
    for got, expected in zip(together[-tables:], alone[-tables:]):
        torch.testing.assert_close(got, expected, rtol=0, atol=rounding * expected.abs().max().item())
    assert len(computed) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's interpreter does not compute bf16")
@pytest.mark.parametrize("case", list(CASES))
def test_bf16_output_and_every_gradient_are_close_to_the_fp32_reference(case):
    lengths, heads, a, d, positions, buckets, max_len = CASES[case]
    q, k, v, offsets, times, lengths_t = jagged_batch(lengths, heads, a, d, buckets, "cuda", torch.bfloat16)
    bias = bias_tables(positions, buckets, "cuda")
    grad = torch.randn(len(q), heads, d, device="cuda")
    got = outputs_and_gradients(
        lambda: kernel.hstu_attention(q, k, v, offsets, times, bias.position, bias.time, max_len), q, k, v, bias, grad
    )
    upcast = [t.detach().float().requires_grad_() for t in (q, k, v)]
    expected = outputs_and_gradients(lambda: reference(*upcast, lengths_t, times, bias), *upcast, bias, grad)
    errors = relative_errors(got, expected)
    assert max(errors.values()) < 1e-2, errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a second CUDA stream and a CUDA graph")
def test_the_bias_sums_beside_dk_and_dq_run_on_their_stream_and_inside_a_captured_graph(monkeypatch):
    """With ``sums_beside`` the two sum passes run on a stream of the device's own, forked from the caller's
    stream after the score gradients are stored and joined before the tables' gradients are returned: the
    gradients equal those of the same kernels on one stream, eagerly and replayed from a CUDA graph that
    captured the forward and backward (a capture ends only where every forked stream has joined)."""
    configs = kernel.kernel_configs
    launch = LAUNCHES["bias sums beside dk and dq"]
    lengths, max_len = [1, 70, 33, 64], 70
    q, k, v, offsets, times, _ = jagged_batch(lengths, 2, 64, 64, 8, "cuda", torch.bfloat16)
    bias = bias_tables(max_len, 8, "cuda")
    grad = torch.randn(len(q), 2, 64, device="cuda", dtype=torch.bfloat16)
    inputs = (q, k, v, bias.position, bias.time)

    def run(beside: bool):
        monkeypatch.setattr(kernel, "kernel_configs", lambda *a: {**configs(*a), **launch, "sums_beside": beside})
        out = kernel.hstu_attention(q, k, v, offsets, times, bias.position, bias.time, max_len)
        return [out, *torch.autograd.grad(out, inputs, grad)]

    one_stream, beside = run(False), run(True)
    assert kernel._SIDE_STREAMS, "no stream of the sums' own was made"
    leaves = tuple(t.detach().clone().requires_grad_() for t in inputs)  # first used on the capture's streams
    graphed = torch.cuda.make_graphed_callables(
        lambda *tensors: kernel.hstu_attention(*tensors[:3], offsets, times, *tensors[3:], max_len), leaves
    )
    out = graphed(*leaves)
    captured = [out, *torch.autograd.grad(out, leaves, grad)]
    for got in (beside, captured):
        for index, (g, e) in enumerate(zip(got, one_stream)):
            if index < 4:  # out, dq, dk, dv: the same kernels on the same inputs, no atomics
                torch.testing.assert_close(g, e, rtol=0, atol=0)
            else:  # the tables' gradients: atomic adds in another order, fp32 rounding
                torch.testing.assert_close(g, e, rtol=0, atol=1e-5 * e.abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's memory statistics")
def test_a_call_under_no_grad_stores_nothing_for_a_backward():
    """At heads of 256 in bf16 the forward stores its scores for the dk/dv kernel (heads x tokens x max_len
    elements); an evaluation under ``torch.no_grad`` must not pay for that memory."""
    q, k, v, offsets, times, _ = jagged_batch([1, 70, 33], 2, 256, 256, 8, "cuda", torch.bfloat16)
    bias = bias_tables(70, 8, "cuda")

    def peak(grad: bool) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.set_grad_enabled(grad):
            kernel.hstu_attention(q, k, v, offsets, times, bias.position, bias.time, 70)
        return torch.cuda.max_memory_allocated() - before

    peak(True), peak(False)  # both compiled and warm
    scores = 2 * (104 + 3 * 64) * 128 * 2  # bytes: heads x (tokens + a tile side per sequence) x 128 columns
    with_grad, without = peak(True), peak(False)  # the peaks differ by the scores, less a few small temporaries
    assert with_grad - without >= 0.9 * scores, (with_grad, without, scores)


def test_bad_inputs_are_refused_with_the_shapes():
    q, k, v, offsets, times, _ = jagged_batch([3, 4], 2, 16, 16, 8, "cpu")
    bias = bias_tables(8, 8, "cpu")
    with pytest.raises(ValueError, match=r"\[tokens, heads, dim\].*\(7, 2, 16\), \(6, 2, 16\)"):
        kernel.hstu_attention(q, k[:6], v, offsets, times, bias.position, bias.time, 8)
    with pytest.raises(ValueError, match="timestamps must be"):
        kernel.hstu_attention(q, k, v, offsets, times[:3], bias.position, bias.time, 8)


def test_float_times_and_empty_tables_are_refused():
    """Float times would be cut to integers for the tiles' time ranges but not for the pairs' buckets (a tile
    whose gaps span two buckets taken as one); an empty table would be read at index -1."""
    q, k, v, offsets, times, _ = jagged_batch([3, 4], 2, 16, 16, 8, "cpu")
    bias = bias_tables(8, 8, "cpu")
    with pytest.raises(ValueError, match="timestamps .seconds. and offsets must be integer tensors, got torch.float64"):
        kernel.hstu_attention(q, k, v, offsets, times.double() + 0.5, bias.position, bias.time, 8)
    with pytest.raises(ValueError, match="the bias tables need at least one entry each, got 8 and 0"):
        kernel.hstu_attention(q, k, v, offsets, times, bias.position, bias.time[:0], 8)


@pytest.mark.parametrize(
    "launch",
    [
        "bias gradients in dq",
        "score gradients stored",
        "position sums by bands",
        "programs in sequences order, score gradients stored, scores stored",
        "dk from the stored score gradients",
        "time sums in the dk kernel",
        "time sums in a pass of their own",
    ],
)
@pytest.mark.parametrize("device", DEVICES)
def test_a_sequence_longer_than_max_len_leaves_the_others_gradients_alone(device, launch, monkeypatch):
    """``max_len`` below a sequence's length is a caller's error the kernel cannot see without a host sync;
    its rows then get no output, but the other sequences' output and gradients stay exact (the stored score
    gradients of the long sequences stay inside their own blocks)."""
    configs = kernel.kernel_configs
    monkeypatch.setattr(kernel, "kernel_configs", lambda *a: {**configs(*a), **LAUNCHES[launch]})
    q, k, v, offsets, times, lengths_t = jagged_batch([50, 3, 44], 2, 16, 16, 8, device)
    bias = bias_tables(40, 8, device)
    grad = torch.randn(len(q), 2, 16, device=device)
    got = outputs_and_gradients(
        lambda: kernel.hstu_attention(q, k, v, offsets, times, bias.position, bias.time, 40), q, k, v, bias, grad
    )
    short = slice(50, 53)
    parts = [t[short].detach().requires_grad_() for t in (q, k, v)]
    expected = outputs_and_gradients(
        lambda: reference(*parts, lengths_t[1:2], times[short], bias), *parts, bias, grad[short]
    )
    for name, g, e in zip(["out", "dq", "dk", "dv"], got[:4], expected[:4]):
        torch.testing.assert_close(g[short], e, rtol=1e-5, atol=1e-6, msg=name)


def test_stored_score_gradients_need_the_bias_gradients_in_the_dq_kernel(monkeypatch):
    configs = kernel.kernel_configs
    monkeypatch.setattr(kernel, "kernel_configs", lambda *a: {**configs(*a), "store_ds": True, "bias_grads": "dkdv"})
    q, k, v, offsets, times, _ = jagged_batch([3, 4], 2, 16, 16, 8, "cpu")
    bias = bias_tables(8, 8, "cpu")
    with pytest.raises(ValueError, match="store_ds: the dq kernel reads the stored score gradients"):
        kernel.hstu_attention(q, k, v, offsets, times, bias.position, bias.time, 8)


@pytest.mark.parametrize(
    "launch, error",
    [
        (
            {"bands": dict(BLOCK_M=16, BLOCK_N=16, CHUNK=2)},
            "bands: the position table's gradient by bands reads the stored",
        ),
        (
            {"store_ds": True, "bands": dict(BLOCK_M=32, BLOCK_N=16, CHUNK=2)},
            "bands: the tiles of a band must be square",
        ),
        (
            {"store_s": True},
            "store_s: the stored scores are read where the score gradients are stored",
        ),
        (
            {"store_ds": True, "time": dict(BLOCK_M=16, BLOCK_N=16)},
            "time: the time sums leave the dq kernel only with the position sums",
        ),
        (
            {"store_ds": True, "bands": dict(BLOCK_M=16, BLOCK_N=16, CHUNK=2), "time": "dk"},
            "time: 'dk' sums the time gradients in the dk kernel, and the launch settings name none",
        ),
        (
            {"store_ds": True, "bands": dict(BLOCK_M=16, BLOCK_N=16, CHUNK=2), "time": "dq"},
            "time: None \\(the time sums in the dq kernel\\), 'dk' or a pass's launch settings, got 'dq'",
        ),
        (
            {"dk": dict(BLOCK_M=16, BLOCK_N=16)},
            "dk: the dk kernel reads the stored score gradients",
        ),
        (
            {"dkdv": dict(BLOCK_M=16, BLOCK_N=16, ORDER="longest")},
            "dkdv: ORDER must be one of index, sequences, blocks, got 'longest'",
        ),
    ],
)
def test_launch_settings_that_cannot_work_are_refused(launch, error, monkeypatch):
    configs = kernel.kernel_configs
    monkeypatch.setattr(kernel, "kernel_configs", lambda *a: {**configs(*a), **launch})
    q, k, v, offsets, times, _ = jagged_batch([3, 4], 2, 16, 16, 8, "cpu")
    bias = bias_tables(8, 8, "cpu")
    with pytest.raises(ValueError, match=error):
        kernel.hstu_attention(q, k, v, offsets, times, bias.position, bias.time, 8)
