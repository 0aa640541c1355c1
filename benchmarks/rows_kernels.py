"""The memory-bound kernel of the fused attention's entry on the seed's shape, under launch settings: the SiLU
of V, Q and K (``_silu_rows``: the projection's last columns, a view whose rows lie the projection's width
apart, into a contiguous tensor), beside torch's SiLU and copy on contiguous tensors of the same size (what the
memory delivers to a plain elementwise kernel).

    python benchmarks/rows_kernels.py [--kernel lightning_hstu/kernels/hstu_attention.py] [--rows 28541]

Per kernel and setting: us per call (median of ``--reps``, CUDA events around each call: ``kernel_ab.time_ms``)
and the bytes read and written per second. Needs a GPU; the kernel module is loaded from its file (torch and
triton only, as ``kernel_ab.py`` does), so neither the package nor TorchRec is imported.
"""

import argparse
import itertools
from pathlib import Path

import torch
import triton
from kernel_ab import load, time_ms
from workloads import WORKLOADS

SEED = WORKLOADS["seed"]
U = V = SEED["num_heads"] * SEED["hidden_dim"]  # the seed's widths
Q = K = SEED["num_heads"] * SEED["attention_dim"]


def time_us(fn, reps: int) -> float:
    return time_ms(fn, reps) * 1e3


def row(name: str, us: float, bytes_moved: int) -> None:
    print(f"{name:<52} {us:9.1f} us {bytes_moved / us / 1e6:8.2f} TB/s")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=28541, help="tokens (the seed benchmark's mean per batch)")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument(
        "--kernel", default=str(Path(__file__).parents[1] / "lightning_hstu" / "kernels" / "hstu_attention.py")
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("rows_kernels.py needs a GPU")
    kernel = load(args.kernel)
    n, width = args.rows, U + V + Q + K
    x = torch.randn(n, width, device="cuda", dtype=torch.bfloat16)
    vqk = x[:, U:]
    size = vqk.numel() * vqk.element_size()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {n} rows")
    dense = vqk.contiguous()
    row("torch SiLU, contiguous [N, V+Q+K]", time_us(lambda: torch.nn.functional.silu(dense), args.reps), 2 * size)
    row("torch copy, contiguous [N, V+Q+K]", time_us(lambda: dense.clone(), args.reps), 2 * size)
    default = dict(kernel.SILU_ROWS_LAUNCH)
    reference = kernel._silu_rows(vqk)
    try:
        for block_r, block_c, warps in itertools.product((4, 8, 16, 32), (256, 512, 1024, 2048), (4, 8)):
            if block_r * block_c > 32768:
                continue
            kernel.SILU_ROWS_LAUNCH = {"BLOCK_R": block_r, "BLOCK_C": block_c, "num_warps": warps}
            torch.testing.assert_close(kernel._silu_rows(vqk), reference, rtol=0, atol=0)
            mark = " (default)" if kernel.SILU_ROWS_LAUNCH == default else ""
            name = f"_silu_rows BLOCK_R={block_r} BLOCK_C={block_c} warps={warps}{mark}"
            row(name, time_us(lambda: kernel._silu_rows(vqk), args.reps), 2 * size)
    finally:
        kernel.SILU_ROWS_LAUNCH = default


if __name__ == "__main__":
    main()
