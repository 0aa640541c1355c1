"""The dense HSTU stack alone on one GPU, kernel by kernel: ``HSTUStack.jagged`` (the fused attention, the
layers' token-wise parts compiled unless ``--eager``) forward and backward under bf16 autocast, on random
tokens of a workload of ``hstu_pipelines.py`` (``--workload``, default seed: width 1024, 10 layers, 4 heads x
256). No embedding tables, losses, optimizer, Lightning or TorchRec: it runs on a bare GPU machine with torch
and Triton, and shows where the dense step's kernel time goes.

    python benchmarks/hstu_stack.py [--workload seed] [--batches 3] [--kernels 30] [--inductor KEY=VALUE ...] \
        [--capacity]

Inputs from ``kernel_ab.py``'s ``make_inputs`` (floor(U^-5) lengths capped at L, batch 32; time gaps up to an
hour, every fifth 0). Prints ms per forward and backward (``kernel_ab.time_ms``: CUDA events, median of
``--steps`` calls) for each batch, the model FLOPs of the stack (the linear maps and attention's two
products, backward as 2x forward: the stack's share of ``HSTURecommender.training_flops``) and their rate,
then torch.profiler's kernels of the last batch, GPU ms per call of the stack. With ``--capacity`` each batch's
token rows are grown with zero rows past the last history, as a CUDA graph of the model's dense part grows them
(``token_capacity`` of its events, plus the histories' first rows, which hold the users): the row counts the
graphed step's linear maps and norms compute, eagerly, for comparing their kernels with the batch's own counts.
"""

import argparse
import ast
import functools
import importlib
import os
import sys
import types

import torch
import torch._inductor.config as inductor_config
from kernel_ab import lengths_for, make_inputs, time_ms
from workloads import WORKLOADS as SHAPES

if "lightning_hstu" not in sys.modules:  # the layers alone: the package's __init__ imports Lightning and TorchRec
    package = types.ModuleType("lightning_hstu")
    package.__path__ = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lightning_hstu")]
    sys.modules["lightning_hstu"] = package
layers = importlib.import_module("lightning_hstu.models.hstu_layers")
graphs = importlib.import_module("lightning_hstu.hstu.graphs")

WORKLOADS = {name: SHAPES[name] for name in ("heavy", "seed", "seed_w128")}  # hstu_pipelines.py's, the dense stack


def stack_flops(lengths: list[int], sizes: dict) -> int:
    width, heads = sizes["embedding_dim"], sizes["num_heads"]
    qk, uv = heads * sizes["attention_dim"], heads * sizes["hidden_dim"]
    tokens, pairs = sum(lengths), sum(n * (n + 1) // 2 for n in lengths)
    per_layer = 2 * tokens * width * (2 * qk + 2 * uv) + 2 * tokens * uv * width + 2 * pairs * (qk + uv)
    return 3 * sizes["num_layers"] * per_layer


def build_stack(workload: str, compile_layers: bool = True, autocast_residual: bool = True):
    """(sizes, ``HSTUStack`` on the GPU) of ``workload``, its weights seeded."""
    sizes = WORKLOADS[workload]
    torch.manual_seed(0)
    config = layers.HSTUConfig(
        **{key: value for key, value in sizes.items() if key != "max_len"},
        max_seq_len=sizes["max_len"],
        compile_layers=compile_layers,
        autocast_residual=autocast_residual,
    )
    return sizes, layers.HSTUStack(config).cuda()


def batch_inputs(sizes: dict, seed: int, capacity: bool = False):
    """(lengths, token count, rows, x, output gradient, offsets, timestamps) of the batch of lengths ``seed``: its
    tokens one "head" as wide as the model; with ``capacity`` its rows grown to a graphed step's count
    (``token_capacity`` of the events, plus a user row per history), zero rows past the last history."""
    lengths = lengths_for(32, sizes["max_len"], seed=seed)
    n = int(lengths.sum())
    tokens, _, grad, offsets, times = make_inputs(lengths, 1, sizes["embedding_dim"], torch.float32, seed=seed)
    x, grad = tokens.view(n, -1), grad.detach().view(n, -1)
    rows = n
    if capacity:  # each history's first row is its user's; the events are the rest
        histories = len(lengths)
        rows = graphs.token_capacity(n - histories, sizes["max_len"] * histories) + histories
        x = graphs._grown(x.detach(), rows).requires_grad_()  # a leaf, as the ungrown input is
        grad, times = graphs._grown(grad, rows), graphs._grown(times, rows)
    return lengths, n, rows, x, grad, offsets, times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="seed", choices=list(WORKLOADS))
    parser.add_argument("--batches", type=int, default=3, help="batches of other lengths (seeds 0, 1, ...)")
    parser.add_argument("--steps", type=int, default=10, help="timed calls per batch (median)")
    parser.add_argument("--kernels", type=int, default=30, help="kernels listed, heaviest first")
    parser.add_argument("--eager", action="store_true", help="the token-wise parts uncompiled")
    parser.add_argument(
        "--fp32-residual", action="store_true", help="HSTUConfig(autocast_residual=False): the residual in float32"
    )
    parser.add_argument(
        "--capacity",
        action="store_true",
        help="the token rows grown to a graphed step's count (token_capacity of the events, plus a user row per "
        "history), zero rows past the last history",
    )
    parser.add_argument(
        "--inductor",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="torch._inductor.config settings for the compiled layers, a Python literal each "
        "(e.g. triton.mix_order_reduction_split_size=128)",
    )
    args = parser.parse_args()
    for setting in args.inductor:
        key, _, value = setting.partition("=")
        section, _, name = key.rpartition(".")
        owner = functools.reduce(getattr, section.split("."), inductor_config) if section else inductor_config
        if not name or not hasattr(owner, name):
            parser.error(f"--inductor {setting}: torch._inductor.config has no setting {key!r}")
        try:
            setattr(owner, name, ast.literal_eval(value))
        except (ValueError, SyntaxError):
            parser.error(f"--inductor {setting}: the value must be a Python literal (a number, True, 'text')")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the fused attention kernel, compiled layers, bf16 autocast)")
    sizes, stack = build_stack(args.workload, not args.eager, not args.fp32_residual)
    settings = f"; inductor {' '.join(args.inductor)}" if args.inductor else ""
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.workload}: {sizes}{settings}")
    for batch in range(args.batches):
        lengths, n, rows, x, grad, offsets, times = batch_inputs(sizes, batch, args.capacity)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = stack.jagged(x, offsets, times)
            y.backward(grad)

        ms = time_ms(step, args.steps)
        flops = stack_flops(lengths.tolist(), sizes)
        peak = torch.cuda.max_memory_allocated() / 2**30
        grown = f" in {rows} rows" if rows != n else ""
        print(
            f"batch {batch}: {n} tokens{grown}, {flops / 1e12:.3f} TFLOP, {ms:.2f} ms per forward and backward, "
            f"{flops / ms / 1e9:.0f} TFLOP/s, peak {peak:.1f} GiB"
        )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    kernels = sorted(
        ((e.key, e.device_time_total / 3 / 1e3, e.count // 3) for e in profiler.key_averages() if e.device_time_total),
        key=lambda kernel: -kernel[1],
    )
    print(f"\nkernels of batch {args.batches - 1}: {sum(k[1] for k in kernels):.2f} ms per call (ms, launches, name)")
    for name, ms, count in kernels[: args.kernels]:
        print(f"{ms:8.3f} {count:4d}  {name[:140]}")


if __name__ == "__main__":
    main()
