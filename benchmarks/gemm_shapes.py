"""The seed layer's matrix products alone, as the compiled layers call them (cuBLAS through aten), against the
rate cuBLAS reaches on a large square product: how far the step's linear maps are from what the GPU gives.

    python benchmarks/gemm_shapes.py [--tokens 28541] [--width 1024] [--projection 4096] [--reps 30] \
        [--bias-columns 8 16 64 128] [--split-u] [--host]

Per product of a layer (f1: the projection, width -> projection with its bias; f2: the output map, width ->
width with its bias; each forward, input gradient and weight gradient): us per call (median of ``--reps``,
CUDA events around each call: ``kernel_ab.time_ms``), TFLOP/s, and the same product with the token count
rounded up to a multiple of 256 (what cuBLAS picks for a round row count); then the ten layers' sum per step.
With ``--bias-columns``, also the bias's gradient as a column sum of the output's gradient (Inductor's way) and
as part of the weight gradient's product with the input widened by a column of ones and zeros up to each given
count of columns (``_BiasInProduct``'s way). With ``--split-u``, f1's three products (the weight gradient's with
the bias in it, 16 columns) as one map against two, U's (width -> the first ``--u-width`` columns) and V, Q and K's
(the rest), whose input gradients add up in the second product: what the split costs in products, against the
U gradient's copy into its columns that it would save (the copy's traffic timed as a contiguous clone). With
``--host``, the host's time per call of each product as ``_BiasInProduct`` makes it (the forward's input a strided
view of the input widened for the bias), the GPU kept busy so that no launch waits for it: at the same token count
every call, at a new token count every call (a jagged training run's batches), and at fifteen counts in turn (the
benchmark's batches, repeated). Needs a GPU; torch only (neither the package nor TorchRec is imported).
"""

import argparse
import statistics
import time

import torch
from kernel_ab import time_ms
from workloads import WORKLOADS

SEED = WORKLOADS["seed"]
LAYERS = SEED["num_layers"]


def operands(rows: int, width: int, out: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A linear map's bf16 input ``[rows, width]``, weight ``[out, width]``, bias and output gradient ``[rows, out]``,
    random, on the GPU."""
    dtype, device = torch.bfloat16, "cuda"
    x = torch.randn(rows, width, dtype=dtype, device=device)
    weight = torch.randn(out, width, dtype=dtype, device=device) / width**0.5
    bias = torch.randn(out, dtype=dtype, device=device)
    dy = torch.randn(rows, out, dtype=dtype, device=device)
    return x, weight, bias, dy


def products(tokens: int, width: int, out: int, reps: int) -> list[tuple[str, float, float]]:
    """(name, us per call, TFLOP/s) of a linear map's forward, input gradient and weight gradient."""
    x, weight, bias, dy = operands(tokens, width, out)
    flop = 2 * tokens * width * out
    calls = {
        "forward (addmm with bias)": lambda: torch.addmm(bias, x, weight.t()),
        "input gradient (dy @ W)": lambda: dy @ weight,
        "weight gradient (dy^T @ x)": lambda: dy.t() @ x,
    }
    rows = []
    for name, call in calls.items():
        us = time_ms(call, reps) * 1e3
        rows.append((name, us, flop / us / 1e6))
    return rows


def widen(x: torch.Tensor, count: int) -> torch.Tensor:
    """``x`` with ``count`` columns more: a column of ones, then zeros (``_BiasInProduct``'s input)."""
    extra = torch.zeros(x.shape[0], count, dtype=x.dtype, device=x.device)
    extra[:, 0] = 1
    return torch.cat([x, extra], dim=1)


def bias_products(tokens: int, width: int, out: int, columns: list[int], reps: int) -> list[tuple[str, float]]:
    """(name, us per call) of a linear map's bias gradient: the column sum of the output's gradient, and the weight
    gradient's product with the input widened by ``c`` columns (ones, then zeros) for each ``c`` of ``columns``."""
    dtype, device = torch.bfloat16, "cuda"
    dy = torch.randn(tokens, out, dtype=dtype, device=device)
    rows = [("bias gradient (column sum of dy)", time_ms(lambda: dy.sum(0), reps) * 1e3)]
    x = torch.randn(tokens, width, dtype=dtype, device=device)
    for count in columns:
        widened = widen(x, count)
        rows.append((f"weight and bias gradients, +{count} columns", time_ms(lambda: dy.t() @ widened, reps) * 1e3))
    return rows


def split_products(tokens: int, width: int, out: int, u_width: int, reps: int) -> list[tuple[str, float]]:
    """(name, us per call) of f1's forward, input gradient and weight gradient (input widened by 16 columns for
    the bias) as one map of ``out`` columns and as two maps of ``u_width`` and ``out - u_width`` columns."""
    x, weight, bias, dy = operands(tokens, width, out)
    widened = widen(x, 16)
    w_u, w_rest = weight[:u_width], weight[u_width:]
    b_u, b_rest = bias[:u_width], bias[u_width:]
    dy_u, dy_rest = dy[:, :u_width].contiguous(), dy[:, u_width:].contiguous()
    dw = torch.empty(out, widened.shape[1], dtype=dy.dtype, device=dy.device)
    calls = {
        "one map: forward": lambda: torch.addmm(bias, x, weight.t()),
        "one map: input gradient": lambda: dy @ weight,
        "one map: weight and bias gradients": lambda: torch.mm(dy.t(), widened, out=dw),
        "two maps: forwards": lambda: (torch.addmm(b_u, x, w_u.t()), torch.addmm(b_rest, x, w_rest.t())),
        "two maps: input gradient (two products, added)": lambda: torch.addmm(dy_u @ w_u, dy_rest, w_rest),
        "two maps: weight and bias gradients": lambda: (
            torch.mm(dy_u.t(), widened, out=dw[:u_width]),
            torch.mm(dy_rest.t(), widened, out=dw[u_width:]),
        ),
        "U's gradient's traffic (a contiguous clone)": lambda: dy_u.clone(),
    }
    return [(name, time_ms(call, reps) * 1e3) for name, call in calls.items()]


def host_us(call, rows: list[int]) -> float:
    """Median host us of ``call(r)`` over the row counts ``rows``; before each call a queued sleep keeps the GPU
    busy, so that the time is the host's (binding, cuBLAS's algorithm choice, the launch), not a wait."""
    times = []
    for r in rows:
        torch.cuda._sleep(1_000_000)
        start = time.perf_counter()
        call(r)
        times.append(time.perf_counter() - start)
        if len(times) % 32 == 0:
            torch.cuda.synchronize()  # a bounded queue
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def host_products(tokens: int, width: int, out: int, calls: int) -> list[tuple[str, float, float, float]]:
    """(name, host us per call at one token count, at a new count every call, at fifteen counts in turn) of a
    linear map's three products as ``_BiasInProduct`` makes them."""
    x, weight, bias, dy = operands(tokens + 8 * calls, width, out)  # rows enough for every count below
    widened = widen(x, 16)
    products = {
        "forward (addmm, strided input)": lambda r: torch.addmm(bias, widened[:r, :width], weight.t()),
        "input gradient (dy @ W)": lambda r: dy[:r] @ weight,
        "weight and bias gradients (dy^T @ [x, 1])": lambda r: dy[:r].t() @ widened[:r],
    }
    rows = []
    for name, call in products.items():
        host_us(call, [tokens] * 8)  # the first call of a shape
        same = host_us(call, [tokens] * calls)
        new = host_us(call, [tokens + 8 + 7 * i for i in range(calls)])
        cycled = host_us(call, [tokens - 3 - 5 * (i % 15) for i in range(calls)])
        rows.append((name, same, new, cycled))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=28541, help="tokens (the seed benchmark's mean per batch)")
    parser.add_argument("--width", type=int, default=SEED["embedding_dim"])
    parser.add_argument(
        "--projection",
        type=int,
        default=SEED["num_heads"] * 2 * (SEED["hidden_dim"] + SEED["attention_dim"]),
        help="f1's output: U, V, Q and K side by side",
    )
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--bias-columns", type=int, nargs="*", default=[], help="columns added for the bias")
    parser.add_argument("--split-u", action="store_true", help="f1 as one map against U's and V, Q and K's maps")
    parser.add_argument("--u-width", type=int, default=SEED["num_heads"] * SEED["hidden_dim"], help="U's columns")
    parser.add_argument("--host", action="store_true", help="the host's us per call: same, new and cycled row counts")
    parser.add_argument("--host-calls", type=int, default=120, help="calls per row-count pattern with --host")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemm_shapes.py needs a GPU")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    if args.host:
        print(f"host us per call (median of {args.host_calls}): same rows / a new row count each call / 15 in turn")
        for map_name, out in (("f1", args.projection), ("f2", args.width)):
            for name, same, new, cycled in host_products(args.tokens, args.width, out, args.host_calls):
                shape = f"{map_name} {args.tokens} x {args.width} -> {out}"
                print(f"{shape}: {name:<44} {same:7.1f} {new:7.1f} {cycled:7.1f}")
        return
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    us = time_ms(lambda: a @ a, args.reps) * 1e3
    print(f"{'square 8192 x 8192 x 8192':<60} {us:9.1f} us {2 * 8192**3 / us / 1e6:7.1f} TFLOP/s")
    rounded = -(-args.tokens // 256) * 256
    total = {args.tokens: 0.0, rounded: 0.0}
    for tokens in (args.tokens, rounded):
        for map_name, out in (("f1", args.projection), ("f2", args.width)):
            for name, us, rate in products(tokens, args.width, out, args.reps):
                total[tokens] += us * LAYERS
                print(f"{map_name} {tokens} x {args.width} -> {out}: {name:<36} {us:9.1f} us {rate:7.1f} TFLOP/s")
            if args.bias_columns and tokens == args.tokens:
                for name, us in bias_products(tokens, args.width, out, args.bias_columns, args.reps):
                    print(f"{map_name} {tokens} x {args.width} -> {out}: {name:<36} {us:9.1f} us")
    if args.split_u:
        for name, us in split_products(args.tokens, args.width, args.projection, args.u_width, args.reps):
            print(f"f1 {args.tokens} x {args.width} -> {args.projection}, U {args.u_width}: {name:<46} {us:9.1f} us")
    for tokens, us in total.items():
        flop = LAYERS * 3 * 2 * tokens * args.width * (args.projection + args.width)
        rate = flop / us / 1e6
        print(f"{LAYERS} layers at {tokens} tokens: {us / 1e3:.2f} ms of products per step, {rate:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
