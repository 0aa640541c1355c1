"""Times versions of the fused HSTU attention kernel beside each other on one GPU, in one process: each
version is a copy of ``lightning_hstu/kernels/hstu_attention.py`` (a file path; the module is standalone:
torch and triton only, so neither the package nor TorchRec is imported). Every version first runs on the
same inputs as the first one and its output and gradients are compared with the first's; then the
versions are timed in turns (round-robin, ``--rounds`` times), so that a GPU's drift over a lease falls on
each version alike.

    git show main:lightning_hstu/kernels/hstu_attention.py > /tmp/base.py
    python benchmarks/kernel_ab.py /tmp/base.py lightning_hstu/kernels/hstu_attention.py [--profile]

Inputs as ``hstu_attention_kernel.py``'s (batch 32, floor(U^-5) lengths capped at L, 4 heads x 128 or x ``--dim``, bf16,
time gaps up to an hour with every fifth gap 0). Without a GPU it runs in Triton's interpreter
(``TRITON_INTERPRET=1``, fp32, ``--shapes tiny``): a smoke run, whose times mean nothing. Per version and
shape: forward and backward ms of each round (the forward under ``torch.no_grad``, or with ``--train-forward`` as
a training step runs it, storing what the backward reads; CUDA events around one call, median of ``--reps``; with
``--queued`` the mean of ``--reps`` calls queued behind a sleep kernel: the GPU's time for them back to back,
without the host's launch time, and with what kernels on two streams gain together), and with ``--profile`` the
GPU time of each of the kernels per call (torch.profiler over 5 calls; kernels that share the GPU each take longer
there).
"""

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch

SHAPES = {"heavy": (32, 1024), "seed": (32, 4096), "tiny": (4, 48)}  # batch, max_len; 4 heads x 128
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: Triton's interpreter, fp32
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32


def load(path: str):
    spec = importlib.util.spec_from_file_location(f"kernel_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lengths_for(batch: int, max_len: int, seed: int = 0) -> torch.Tensor:
    """floor(U^-5) capped to [2, max_len], U uniform in float64 (the same lengths as the anchors' harness)."""
    u = torch.rand(batch, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).clamp_min(1e-300)
    return u.pow(-5.0).clamp(max=float(max_len)).floor().long().clamp(2, max_len)


def make_inputs(lengths, heads, dim, dtype, seed=0, device="cuda"):
    """Random q, k, v and times (gaps up to an hour, every fifth 0: the first bucket) and the offsets."""
    gen = torch.Generator().manual_seed(seed)
    n = int(lengths.sum())
    q, k, v = (torch.randn(n, heads, dim, generator=gen).to(device, dtype).requires_grad_() for _ in range(3))
    gaps = torch.randint(0, 3600, (n,), generator=gen)
    gaps[::5] = 0
    times = torch.cumsum(gaps, 0).to(device)
    offsets = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(device)
    return q, k, v, offsets, times


def bias_tables(max_len: int, buckets: int = 64, seed: int = 1):
    """The position and time tables, N(0, 0.25) entries (``HSTUConfig``'s sizes)."""
    gen = torch.Generator().manual_seed(seed)
    return tuple((0.5 * torch.randn(size, generator=gen)).to(DEVICE).requires_grad_() for size in (max_len, buckets))


def time_ms(fn, reps: int = 20, queued: bool = False) -> float:
    """GPU ms per call of ``fn``: the median of ``reps`` calls, each between two CUDA events (its host time
    shows where the GPU waits for the launches); ``queued``: the mean of ``reps`` calls queued behind a sleep
    kernel, the GPU's own time for them back to back (concurrent streams, kernel tails and launch gaps, not
    the host's time)."""
    if DEVICE.type != "cuda":  # the interpreter: a smoke run, the times mean nothing
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if queued:
        return _queued_ms(fn, reps)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _queued_ms(fn, reps: int) -> float:
    """``reps`` calls of ``fn`` launched while a sleep kernel holds the GPU (long enough for the host to queue them
    all: ten times the host's time for them), timed between CUDA events on the GPU; the mean per call."""
    begin = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    host_ms = (time.perf_counter() - begin) * 1e3
    probe = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probe[0].record()
    torch.cuda._sleep(10_000_000)
    probe[1].record()
    probe[1].synchronize()
    cycles_per_ms = 10_000_000 / probe[0].elapsed_time(probe[1])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(10 * host_ms * cycles_per_ms))
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="+", help="kernel source files; the first is the baseline")
    parser.add_argument("--shapes", nargs="+", default=["heavy", "seed"], choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20, help="calls per timing (median)")
    parser.add_argument("--profile", action="store_true", help="GPU time per call of each kernel")
    parser.add_argument("--dim", type=int, default=128, help="the heads' width (q, k, v); 4 heads")
    parser.add_argument("--lengths-seed", type=int, default=0, help="the batch's lengths (seed 1: 36,026 tokens)")
    parser.add_argument(
        "--queued",
        action="store_true",
        help="time the calls queued behind a sleep kernel (the GPU's time back to back, not the host's per call)",
    )
    parser.add_argument(
        "--train-forward",
        action="store_true",
        help="time the forward as a training step runs it (autograd on: what the backward needs is stored) instead "
        "of under torch.no_grad; bwd is then a forward and backward less that",
    )
    args = parser.parse_args()
    modules = {path: load(path) for path in args.versions}
    device = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "CPU (Triton's interpreter)"
    print(f"# {device}, torch {torch.__version__}")
    for shape in args.shapes:
        batch, max_len = SHAPES[shape]
        lengths = lengths_for(batch, max_len, args.lengths_seed)
        q, k, v, offsets, times = make_inputs(lengths, 4, args.dim, DTYPE, device=DEVICE)
        position, time = bias_tables(max_len)
        grad = torch.randn_like(v)
        print(f"\n## {shape}: {int(lengths.sum())} tokens, max_len {max_len}, 4 heads x {args.dim}")

        def call(module):
            return module.hstu_attention(q, k, v, offsets, times, position, time, max_len)

        first = None
        for path, module in modules.items():
            for t in (q, k, v, position, time):
                t.grad = None
            out = call(module)
            out.backward(grad)
            got = [t.float() for t in (out, q.grad, k.grad, v.grad, position.grad, time.grad)]
            if first is None:
                first = got
                continue
            errors = [((a - b).norm() / b.norm()).item() for a, b in zip(got, first)]
            names = ["out", "dq", "dk", "dv", "dposition", "dtime"]
            print(
                f"{path}: relative difference to {args.versions[0]}: "
                + " ".join(f"{n}={e:.1e}" for n, e in zip(names, errors))
            )
        results = {path: ([], []) for path in modules}
        for _ in range(args.rounds):
            for path, module in modules.items():

                def forward(module=module):
                    with torch.set_grad_enabled(args.train_forward):
                        call(module)

                def both(module=module):
                    torch.autograd.backward(call(module), grad)

                fwd = time_ms(forward, args.reps, args.queued)
                results[path][0].append(fwd)
                results[path][1].append(time_ms(both, args.reps, args.queued) - fwd)
        for path, (fwd, bwd) in results.items():
            print(
                f"{path}: fwd ms "
                + " ".join(f"{x:.3f}" for x in fwd)
                + " | bwd ms "
                + " ".join(f"{x:.3f}" for x in bwd)
            )
        if args.profile and DEVICE.type == "cuda":
            for path, module in modules.items():
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
                    for _ in range(5):
                        torch.autograd.backward(call(module), grad)
                    torch.cuda.synchronize()
                kernels = {
                    e.key: e.device_time_total / 5 / 1e3 for e in profiler.key_averages() if e.key.startswith("_hstu")
                }
                print(f"{path}: ms per call " + " ".join(f"{name} {ms:.3f}" for name, ms in sorted(kernels.items())))


if __name__ == "__main__":
    main()
