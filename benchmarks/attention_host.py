"""The host's time per call of the fused attention (``projected_attention`` as an HSTU layer calls it: its
Python, its tensor descriptors and its Triton launches), forward and backward, on the seed's layer widths and
a batch small enough that the GPU finishes each kernel before the host has launched the next: what the host
pays per layer whatever the batch. Beside it, the same time inside Triton's launches alone (each kernel's
``kernel[grid](...)``), and a plain aten launch for scale.

    python benchmarks/attention_host.py [--calls 200] [--sequences 32] [--length 64]

Per phase: host us per call (median over ``--calls`` calls; the GPU synchronised before each call, not
inside it). Needs a GPU; the kernel module is loaded from its file (torch and triton only, as ``kernel_ab.py``
does).
"""

import argparse
import cProfile
import inspect
import pstats
import statistics
import time
from pathlib import Path

import torch
from kernel_ab import load
from workloads import WORKLOADS

attention = load(str(Path(__file__).parents[1] / "lightning_hstu" / "kernels" / "hstu_attention.py"))

SEED = WORKLOADS["seed"]
KERNELS = (
    "_hstu_fwd",
    "_hstu_bwd_dkdv",
    "_hstu_bwd_dk_stored",
    "_hstu_bwd_time_stored",
    "_hstu_bwd_dq_stored",
    "_hstu_bwd_position_bands",
    "_hstu_bwd_dq",
    "_silu_rows_kernel",
    "_time_ranges",
)


class _Timed:
    """A Triton kernel whose launches (``kernel[grid](...)``) add their host time to ``spent[name]``."""

    def __init__(self, name, kernel, spent):
        self.name, self.kernel, self.spent = name, kernel, spent
        self.last = None  # the last launch: grid, arguments, keyword arguments, the compiled kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = launch(*args, **kwargs)
            self.spent[self.name].append(time.perf_counter() - start)
            self.last = grid, args, kwargs, result
            return result

        return timed


def direct_launches(timed: _Timed, reps: int, busy) -> tuple[float, float]:
    """Host us per launch of the last launch's arguments again, through ``kernel[grid](...)`` and through the
    compiled kernel's own launcher (``CompiledKernel.run``: no binding, specialization or cache lookup), the
    GPU kept busy by ``busy()``: what a launch cache could save per launch at most."""
    grid, args, kwargs, compiled = timed.last
    signature = inspect.signature(timed.kernel.fn)
    bound = signature.bind(*args, **{k: v for k, v in kwargs.items() if k in signature.parameters})
    bound.apply_defaults()
    values = list(bound.arguments.values())
    grid = (*grid, 1, 1)[:3]
    stream = torch.cuda.current_stream().cuda_stream
    busy()

    def usual():
        timed.kernel[grid](*args, **kwargs)

    def direct():
        compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *values)

    results = []
    for launch in (usual, direct):
        launch()
        torch.cuda.synchronize()
        busy()
        start = time.perf_counter()
        for _ in range(reps):
            launch()
        results.append((time.perf_counter() - start) / reps * 1e6)
        torch.cuda.synchronize()
    return tuple(results)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--length", type=int, default=64, help="tokens per sequence")
    parser.add_argument(
        "--busy", action="store_true", help="the GPU kept busy (a queued sleep) while the host launches, as in a step"
    )
    parser.add_argument(
        "--later-layer", action="store_true", help="one batch plan for every call (as the layers after the first)"
    )
    parser.add_argument(
        "--direct", action="store_true", help="also each kernel's launch through its compiled kernel's launcher"
    )
    parser.add_argument("--profile", type=int, default=0, help="also cProfile's N heaviest functions by own time")
    parser.add_argument("--device", default="cuda", help="cpu: Triton's interpreter (TRITON_INTERPRET=1), a check")
    args = parser.parse_args()
    device = torch.device(args.device)
    idle = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def sync():
        idle()
        if args.busy:
            torch.cuda._sleep(4_000_000)  # about 2 ms of the GPU's time

    heads, a, d = SEED["num_heads"], SEED["attention_dim"], SEED["hidden_dim"]
    tokens = args.sequences * args.length
    offsets = torch.arange(0, tokens + 1, args.length, device=device)
    timestamps = torch.cumsum(torch.randint(0, 1000, (tokens,), device=device), 0)
    position = torch.zeros(SEED["max_len"], device=device, requires_grad=True)
    table = torch.zeros(64, device=device, requires_grad=True)
    x = torch.randn(tokens, heads * (2 * a + 2 * d), device=device, dtype=torch.bfloat16, requires_grad=True)
    grads = torch.randn(tokens, heads * d, device=device, dtype=torch.bfloat16)
    spent = {name: [] for name in KERNELS}
    for name in KERNELS:
        setattr(attention, name, _Timed(name, getattr(attention, name), spent))
    phases = {"forward": [], "backward": [], "aten add (scale)": []}
    small = torch.ones(16, device=device)
    profiler = cProfile.Profile()  # from Python 3.12 it sees every thread (the GPU backward: autograd's)
    shared = {}
    for call in range(args.calls + 10):
        plans = shared if args.later_layer else {}  # a new plan at every call: the first layer's cost
        if call == 10 and args.profile:
            profiler.enable()
        sync()
        start = time.perf_counter()
        u, out = attention.projected_attention(
            x, heads, a, d, offsets, timestamps, position, table, args.length, True, plans, silu_u=False
        )
        forward = time.perf_counter() - start
        sync()
        start = time.perf_counter()
        torch.autograd.backward((u, out), (grads, grads))
        backward = time.perf_counter() - start
        sync()
        start = time.perf_counter()
        for _ in range(20):
            small.add_(1)
        add = (time.perf_counter() - start) / 20
        if call >= 10:  # compilations and the allocator's first calls
            phases["forward"].append(forward)
            phases["backward"].append(backward)
            phases["aten add (scale)"].append(add)
        else:
            for values in spent.values():
                values.clear()
        x.grad = position.grad = table.grad = None
    profiler.disable()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}, {tokens} tokens, heads {heads} x {a}, {args.calls} calls")
    for name, values in phases.items():
        print(f"{name:<28} {statistics.median(values) * 1e6:8.1f} us per call")
    for name, values in spent.items():
        if values:
            per_call = len(values) / args.calls
            print(f"  launch {name:<28} {statistics.median(values) * 1e6:8.1f} us per launch, {per_call:.0f} per call")
    for name in spent if args.direct else ():
        timed = getattr(attention, name)
        if timed.last is not None:
            try:
                usual, direct = direct_launches(timed, 100, lambda: torch.cuda._sleep(50_000_000))
                print(f"  {name:<28} kernel[grid](...) {usual:8.1f} us, its launcher alone {direct:8.1f} us per launch")
            except Exception as error:  # another Triton's launcher: say so, time the rest
                print(f"  {name:<28} launcher alone: {type(error).__name__}: {error}")
    if args.profile:
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(args.profile)
        stats.sort_stats("cumulative").print_stats(args.profile)


if __name__ == "__main__":
    main()
