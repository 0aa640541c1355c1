"""What a token count met for the first time costs the dense HSTU stack, as a training run meets one nearly every
step (the benchmark of record, ``hstu_pipelines.py`` without ``--fresh``, repeats ten batches).

    python benchmarks/first_meeting.py [--workload seed] [--counts 20] [--profile] [--capacity]

``HSTUStack.jagged`` forward and backward (the fused attention, the token-wise parts compiled, bf16 autocast) on
``--counts`` batches of new lengths (``kernel_ab.py``'s, seeds 0, 1, ...), after three others have compiled and
warmed it. For each batch: the wall ms (a synchronize on either side) of its first, second and third call, and
the caching allocator's calls into CUDA during the first two (cudaMalloc, cudaFree, retries: a retry frees every
cached block, waiting for the device). With ``--profile`` the first two calls run under torch.profiler (CPU ops
only; their wall times include its cost): the host's time in the matrix products (``aten::mm`` and
``aten::addmm``, where cuBLAS picks a kernel for a shape it has not met) at each, and at the end the host ops
whose self time grew most from the second call to the first, summed over the batches. ``--capacity`` grows each
batch's rows to a graphed step's count (``hstu_stack.py --capacity``), so that batches share row counts. Needs a
GPU; neither Lightning nor TorchRec is imported.
"""

import argparse
import contextlib
import time
from collections import defaultdict

import torch
from hstu_stack import WORKLOADS, batch_inputs, build_stack

ALLOCATOR = ("num_device_alloc", "num_device_free", "num_alloc_retries")
PRODUCTS = ("aten::mm", "aten::addmm")
WARM_SEEDS = (100, 101, 102)


def batch_step(stack, sizes: dict, seed: int, capacity: bool):
    """(token count, rows, step) of the batch of lengths ``seed``: ``step()`` runs its forward and backward."""
    _, n, rows, x, grad, offsets, times = batch_inputs(sizes, seed, capacity)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = stack.jagged(x, offsets, times)
        y.backward(grad)

    return n, rows, step


def call(step, profile: bool) -> tuple[float, tuple[int, ...], dict]:
    """(wall ms, the allocator's calls into CUDA, {host op: self CPU us} under ``profile``) of one ``step()``."""
    before = torch.cuda.memory_stats()
    torch.cuda.synchronize()
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
    with profiler or contextlib.nullcontext():
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1e3
    ops = {event.key: event.self_cpu_time_total for event in profiler.key_averages()} if profile else {}
    after = torch.cuda.memory_stats()
    return ms, tuple(after.get(key, 0) - before.get(key, 0) for key in ALLOCATOR), ops


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="seed", choices=list(WORKLOADS))
    parser.add_argument("--counts", type=int, default=20, help="batches of new lengths (seeds 0, 1, ...)")
    parser.add_argument("--profile", action="store_true", help="the host ops of the first two calls (torch.profiler)")
    parser.add_argument("--capacity", action="store_true", help="each batch's rows grown to a graphed step's count")
    parser.add_argument("--top", type=int, default=15, help="host ops listed under --profile")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the fused attention kernel, compiled layers, bf16 autocast)")
    sizes, stack = build_stack(args.workload)
    for seed in WARM_SEEDS:
        step = batch_step(stack, sizes, seed, args.capacity)[2]
        for _ in range(3):
            call(step, False)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.workload}, rows grown: {args.capacity}")
    print("seed tokens   rows      first  second   third ms  allocator first, second  products' host ms first, second")
    grew, met = defaultdict(float), set()
    for seed in range(args.counts):
        n, rows, step = batch_step(stack, sizes, seed, args.capacity)
        first, second, third = call(step, args.profile), call(step, args.profile), call(step, False)
        products = ""
        if args.profile:
            host = [sum(ops.get(op, 0.0) for op in PRODUCTS) / 1e3 for ops in (first[2], second[2])]
            products = f"{host[0]:8.2f} {host[1]:6.2f}"
            for op, us in first[2].items():
                grew[op] += us - second[2].get(op, 0.0)
        seen = "met before" if rows in met else "new"
        met.add(rows)
        print(
            f"{seed:4d} {n:6d} {rows:6d} {seen:>10} {first[0]:7.2f} {second[0]:7.2f} {third[0]:7.2f}"
            f"  {first[1]} {second[1]}  {products}"
        )
    if args.profile:
        print(f"host self time, first call minus second, summed over the {args.counts} batches (ms):")
        for op, us in sorted(grew.items(), key=lambda item: -item[1])[: args.top]:
            print(f"{us / 1e3:9.2f}  {op[:110]}")


if __name__ == "__main__":
    main()
