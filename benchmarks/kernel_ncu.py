"""One forward and backward of the fused HSTU attention on a seed batch, between ``cudaProfilerStart`` and
``cudaProfilerStop``, for Nsight Compute to profile the kernels of that one call (the calls before it compile
the kernels and warm the caches). The kernel file is a copy of ``lightning_hstu/kernels/hstu_attention.py``
(as ``kernel_ab.py`` takes them); the inputs are ``kernel_ab.py``'s (32 sequences of floor(U^-5) lengths up
to 4096, 4 heads x ``--dim``, bf16).

    ncu --profile-from-start off --clock-control none --import-source no \\
        -k regex:"_hstu_fwd|_hstu_bwd_dkdv|_hstu_bwd_dq_stored|_hstu_bwd_dk_stored" \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters \\
        -o attn python benchmarks/kernel_ncu.py lightning_hstu/kernels/hstu_attention.py --lengths-seed 1
    ncu -i attn.ncu-rep --page details
    ncu -i attn.ncu-rep --page source --print-source sass --csv -k _hstu_fwd > fwd.csv   # stalls per instruction

Needs a GPU; torch and triton only (neither the package nor TorchRec is imported).
"""

import argparse

import torch
from kernel_ab import bias_tables, lengths_for, load, make_inputs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", help="a copy of lightning_hstu/kernels/hstu_attention.py")
    parser.add_argument("--lengths-seed", type=int, default=1, help="the batch's lengths (seed 1: 36,026 tokens)")
    parser.add_argument("--dim", type=int, default=256, help="the heads' width (q, k, v); 4 heads")
    parser.add_argument("--max-len", type=int, default=4096)
    args = parser.parse_args()
    module = load(args.file)
    lengths = lengths_for(32, args.max_len, args.lengths_seed)
    q, k, v, offsets, times = make_inputs(lengths, 4, args.dim, torch.bfloat16)
    position, time = bias_tables(args.max_len)
    grad = torch.randn_like(v)

    def call():
        out = module.hstu_attention(q, k, v, offsets, times, position, time, args.max_len)
        torch.autograd.backward(out, grad)

    for _ in range(2):
        call()
    torch.cuda.synchronize()
    print(f"{int(lengths.sum())} tokens, 4 heads x {args.dim}")
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
