"""Host time per call of the small pieces of an HSTU step that run on the compute thread besides TorchRec and
the graphs, on the benchmark's batches: what a cut in one of them saves, measured on its own (a cut of
0.1 ms is below what whole-step runs in separate processes can show).

    python benchmarks/host_parts.py [--workload light] [--device cuda] [--calls 2000] [--repeats 5]

Each part runs ``--calls`` times over the batches (already on the device), after a warm-up; prints per
part the median over ``--repeats`` of the mean us per call. The device's queue is drained between parts,
not between calls (as in a step, whose launches queue behind each other). To compare two versions of the
package, run the script with each on ``PYTHONPATH`` (``benchmarks/package_ab.py`` exports a revision's).
A loop keeps the pieces' code and data in the caches: inside a step the same operations took several
times longer (BENCHMARKS.md), so these times are a lower bound of what a cut saves there.
"""

import argparse
import statistics
import time

import torch
from hstu_pipelines import WORKLOADS, make_batches

from lightning_hstu.hstu.step import global_tokens, sparse_features
from lightning_hstu.models.hstu import JaggedLayout


def time_part(fn, batches, calls: int, device: torch.device) -> float:
    for batch in batches[:10]:
        fn(batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for i in range(calls):
        fn(batches[i % len(batches)])
    elapsed = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return elapsed / calls * 1e6


def token_rows(batches, width: int, device: torch.device):
    """``JaggedLayout.tokens`` forward and backward on each batch's histories (its real events as the
    capacity), rows as wide as the workload's model: the stack's input assembled from the user and event
    rows, and their gradients taken back out."""
    cases = {}
    for batch in batches:
        lengths = batch.sequence_lengths()
        capacity = int(lengths.sum())
        layout = JaggedLayout(lengths, capacity)
        user = torch.randn(len(lengths), width, device=device, requires_grad=True)
        events = torch.randn(capacity, width, device=device, requires_grad=True)
        cases[id(batch)] = layout, user, events, torch.randn(layout.size, width, device=device)

    def run(batch):
        layout, user, events, grad = cases[id(batch)]
        torch.autograd.grad(layout.tokens(user, events), (user, events), grad)

    return run


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="light", choices=list(WORKLOADS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--negatives", type=int, default=128)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    if not torch.distributed.is_initialized():  # global_tokens asks for the world size
        torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    sizes = WORKLOADS[args.workload]
    host = make_batches(20, args.batch_size, sizes["max_len"], 100_000, args.negatives)
    batches = [b.to(device) for b in host]
    on_host = dict(zip(map(id, batches), host))  # the h2d part copies each batch's host twin
    table = {
        "sparse_features (split, bags of 32)": sparse_features,
        "global_tokens": global_tokens,
        "HSTUBatch.to (h2d)": lambda batch: on_host[id(batch)].to(device),
        "JaggedLayout.tokens, forward and backward": token_rows(batches, sizes["embedding_dim"], device),
    }
    print(f"{args.workload} batches ({args.batch_size} histories), {device}, torch {torch.__version__}")
    for name, fn in table.items():
        runs = [time_part(fn, batches, args.calls, device) for _ in range(args.repeats)]
        print(f"  {name:40s} {statistics.median(runs):8.1f} us per call (runs {min(runs):.1f}-{max(runs):.1f})")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
