"""The host's time per call of the fused attention (``projected_attention`` as an HSTU layer calls it: its
Python, its tensor descriptors and its Triton launches), forward and backward, on the seed's layer widths and
a batch small enough that the GPU finishes each kernel before the host has launched the next: what the host
pays per layer whatever the batch. Beside it, the same time inside Triton's launches alone (each kernel's
``kernel[grid](...)``), and a plain aten launch for scale.

    python benchmarks/attention_host.py [--calls 200] [--sequences 32] [--length 64]

Per phase: host us per call (median over ``--calls`` calls; the GPU synchronised before each call, not
inside it). Needs a GPU.
"""

import argparse
import statistics
import time

import torch
from workloads import WORKLOADS

from lightning_hstu.kernels import hstu_attention as attention

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

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = launch(*args, **kwargs)
            self.spent[self.name].append(time.perf_counter() - start)
            return result

        return timed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--length", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--device", default="cuda", help="cpu: Triton's interpreter (TRITON_INTERPRET=1), a check")
    args = parser.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
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
    for call in range(args.calls + 10):
        plans = {}  # a new batch's plan at every call: the first layer's cost (the others reuse it)
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
        small.add_(1)
        add = time.perf_counter() - start
        if call >= 10:  # compilations and the allocator's first calls
            phases["forward"].append(forward)
            phases["backward"].append(backward)
            phases["aten add (scale)"].append(add)
        else:
            for values in spent.values():
                values.clear()
        x.grad = position.grad = table.grad = None
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}, {tokens} tokens, heads {heads} x {a}, {args.calls} calls")
    for name, values in phases.items():
        print(f"{name:<28} {statistics.median(values) * 1e6:8.1f} us per call")
    for name, values in spent.items():
        if values:
            per_call = len(values) / args.calls
            print(f"  launch {name:<28} {statistics.median(values) * 1e6:8.1f} us per launch, {per_call:.0f} per call")


if __name__ == "__main__":
    main()
