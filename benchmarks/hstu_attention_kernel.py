"""The fused jagged HSTU attention kernel alone, on one GPU: checked against the padded PyTorch reference,
then timed forward and forward + backward (CUDA events, median), beside the padded reference's attention.

    python benchmarks/hstu_attention_kernel.py [--shapes heavy seed] [--sweep]

Shapes: batch 32, zipf(1.2)-like lengths (P(length > x) ~ x^-0.2, the benchmark's batches) capped at L;
heavy L=1024, 4 heads x 128 (attention and hidden width); seed L=4096, 4 heads x 256 (the seed's shape);
seed_d128 the seed's lengths with 4 heads x 128. FLOPs per forward:
sum_b n_b (n_b + 1) / 2 * heads * (2 attention_dim + 2 hidden_dim) (the causal pairs, two matrix products);
a backward is counted as 2x the forward (model FLOPs: dq, dk, dv; the kernels' recomputation of the
scores is not counted) and, beside it, as 2.5x (the convention of published HSTU kernel numbers).
"""

import argparse

import torch
import triton
from kernel_ab import lengths_for, make_inputs, time_ms

from lightning_hstu.kernels import hstu_attention as kernel
from lightning_hstu.models.hstu_layers import HSTUConfig, PaddedTokens, RelativeBias, to_padded

SHAPES = {
    "heavy": dict(max_len=1024, heads=4, dim=128),
    "seed": dict(max_len=4096, heads=4, dim=256),  # the seed's: 4 heads of 256 (kv_channels) over width 1024
    "seed_d128": dict(max_len=4096, heads=4, dim=128),  # the same lengths with heads of 128
    "seed_h8": dict(max_len=4096, heads=8, dim=128),
}
SWEEP = (  # candidate launch settings, one kernel at a time (each checked against the reference before timing)
    [
        {"fwd": dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)}
        for m, n, w, s in [(128, 64, 8, 2), (128, 64, 4, 2), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3)]
    ]
    + [
        {"dkdv": dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)}
        for m, n, w, s in [
            (32, 64, 4, 3),
            (32, 64, 8, 2),
            (64, 64, 8, 2),
            (32, 128, 8, 2),
            (64, 128, 8, 2),
            (32, 128, 8, 3),
            (16, 64, 4, 3),
        ]
    ]
    + [
        {"dq": dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)}
        for m, n, w, s in [(64, 32, 4, 3), (128, 32, 8, 2), (128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 3)]
    ]
)
SWEEP_WIDE = (  # the same for heads of 256: accumulators twice as wide
    [
        {"fwd": dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)}
        for m, n, w, s in [(64, 32, 4, 3), (64, 64, 4, 2), (128, 64, 8, 2), (64, 16, 4, 2)]
    ]
    + [
        {"dkdv": dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)}
        for m, n, w, s in [(32, 64, 4, 2), (64, 64, 8, 2), (32, 64, 8, 3), (16, 64, 4, 2), (32, 128, 8, 2)]
    ]
    + [
        {"dq": dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)}
        for m, n, w, s in [(64, 32, 4, 2), (32, 32, 4, 3), (32, 32, 8, 2), (32, 16, 8, 2), (16, 16, 4, 2)]
    ]
    + [
        {"dk": dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)}
        for m, n, w, s in [(32, 128, 8, 3), (32, 64, 4, 4), (64, 128, 8, 2)]
    ]
    + [
        {"time": dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)}
        for m, n, w, s in [(64, 64, 4, 2), (32, 64, 4, 3), (64, 32, 4, 3)]
    ]
    + [
        {"time": None, "dq": dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=3)},  # the time sums in dq
        {"dk": None, "dkdv": dict(BLOCK_M=32, BLOCK_N=64, num_warps=8, num_stages=3)},  # dk in the dk/dv kernel
        {"time": None, "bands": None},  # the position and time sums in the stored dq kernel
        {"bands": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, CHUNK=64)},  # a band in one program
        {"bands": dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=3, CHUNK=32)},
        {"store_ds": False, "store_s": False, "dk": None, "time": None, "bands": None},  # dq recomputes S, dP
        {"store_ds": False, "store_s": False, "dk": None, "time": None, "bands": None, "bias_grads": "dkdv"},
        {
            "store_ds": False,
            "store_s": False,
            "dk": None,
            "time": None,
            "bands": None,
            "bias_grads": "dkdv",
            "dq": dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2),
        },
    ]
)


def bias_tables(max_len, device):
    bias = RelativeBias(HSTUConfig(max_seq_len=max_len)).to(device)
    torch.nn.init.normal_(bias.position, std=0.5)
    torch.nn.init.normal_(bias.time, std=0.5)
    return bias


def flops(lengths, heads, dim):
    pairs = sum(int(n) * (int(n) + 1) // 2 for n in lengths)
    return pairs * heads * 4 * dim


def padded_attention(q, k, v, lengths, times, bias):
    qp, mask = to_padded(q, lengths)
    kp, _ = to_padded(k, lengths)
    vp, _ = to_padded(v, lengths)
    tp, _ = to_padded(times, lengths)
    return PaddedTokens(mask, bias.indices(tp)).attend(qp, kp, vp, bias)[mask]


def errors(lengths, heads, dim, dtype, max_len):
    """Relative errors of the kernel's output and gradients against the fp32 reference on the same inputs."""
    q, k, v, offsets, times = make_inputs(lengths, heads, dim, dtype, seed=1)
    bias = bias_tables(max_len, q.device)
    out = kernel.hstu_attention(q, k, v, offsets, times, bias.position, bias.time, max_len)
    grad = torch.randn_like(out, dtype=torch.float32)
    (out.float() * grad).sum().backward()
    got = [out.float(), *(t.grad.float() for t in (q, k, v)), bias.position.grad, bias.time.grad]
    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    bias.zero_grad()
    ref = padded_attention(*ref_inputs, lengths.to(q.device), times, bias)
    (ref * grad).sum().backward()
    expected = [ref, *(t.grad for t in ref_inputs), bias.position.grad, bias.time.grad]
    return {
        name: ((a - b).norm() / b.norm()).item()
        for name, a, b in zip(["out", "dq", "dk", "dv", "dposition", "dtime"], got, expected)
    }


def time_kernel(lengths, heads, dim, max_len):
    q, k, v, offsets, times = make_inputs(lengths, heads, dim, torch.bfloat16)
    bias = bias_tables(max_len, q.device)
    grad = torch.randn_like(v)

    def forward():
        with torch.no_grad():
            kernel.hstu_attention(q, k, v, offsets, times, bias.position, bias.time, max_len)

    def both():
        out = kernel.hstu_attention(q, k, v, offsets, times, bias.position, bias.time, max_len)
        torch.autograd.backward(out, grad)

    fwd = time_ms(forward)
    total = time_ms(both)
    return fwd, total


def time_padded(lengths, heads, dim, max_len):
    q, k, v, offsets, times = make_inputs(lengths, heads, dim, torch.bfloat16)
    bias = bias_tables(max_len, q.device)
    lengths = lengths.to(q.device)

    def both():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = padded_attention(q, k, v, lengths, times, bias)
        out.float().sum().backward()

    torch.cuda.reset_peak_memory_stats()
    ms = time_ms(both, reps=5)
    return ms, torch.cuda.max_memory_allocated() / 2**30


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["heavy", "seed"], choices=list(SHAPES))
    parser.add_argument("--sweep", action="store_true", help="time the candidate launch settings too")
    parser.add_argument("--padded", action="store_true", help="time the padded reference (heavy only fits)")
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    check_lengths = torch.tensor([1, 512, 300, 17, 511, 64, 2, 129])
    for dim in sorted({SHAPES[name]["dim"] for name in args.shapes}):
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
            err = errors(check_lengths, 4, dim, dtype, 512)
            print(
                f"check heads of {dim} {str(dtype):15} " + " ".join(f"{k}={v:.1e}" for k, v in err.items()),
                "OK" if max(err.values()) < tol else "FAILED",
            )
    default = kernel.kernel_configs
    for name in args.shapes:
        shape = SHAPES[name]
        lengths = lengths_for(32, shape["max_len"])
        fwd_flops = flops(lengths, shape["heads"], shape["dim"])
        print(
            f"\n## {name}: {shape}, {int(lengths.sum())} tokens (median {int(lengths.median())}, "
            f"{int((lengths == shape['max_len']).sum())} at max_len), {fwd_flops / 1e9:.1f} GFLOP forward"
        )
        candidates = [{}] + ((SWEEP_WIDE if shape["dim"] > 128 else SWEEP) if args.sweep else [])
        for override in candidates:
            kernel.kernel_configs = lambda *a, o=override: {**default(*a), **o}
            try:
                fwd, total = time_kernel(lengths, shape["heads"], shape["dim"], shape["max_len"])
            except Exception as error:  # a candidate that does not compile or fit
                print(f"{str(override) or 'default':80} failed: {type(error).__name__}: {str(error)[:100]}")
                continue
            bwd = total - fwd
            print(
                f"{str(override) or 'default':80} fwd {fwd:7.3f} ms {fwd_flops / fwd / 1e9:6.1f} TFLOP/s | "
                f"bwd {bwd:7.3f} ms {2 * fwd_flops / bwd / 1e9:6.1f} (2x) "
                f"{2.5 * fwd_flops / bwd / 1e9:6.1f} (2.5x) | "
                f"fwd+bwd {total:7.3f} ms {3 * fwd_flops / total / 1e9:6.1f} TFLOP/s"
            )
        kernel.kernel_configs = default
        if args.padded and name == "heavy":
            ms, gib = time_padded(lengths, shape["heads"], shape["dim"], shape["max_len"])
            print(f"padded reference attention fwd+bwd {ms:.2f} ms, peak {gib:.1f} GiB")


if __name__ == "__main__":
    main()
