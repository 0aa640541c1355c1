"""finalize_model_grads (megatron-core) gives every rank the all-reduced mean gradient of the dense part."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_hstu.hstu.dense_grads import MegatronDenseGrads


def make_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.SiLU(), nn.Linear(8, 1))


def rank_input(rank):
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))


def _rank(rank, world, init_file, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        net = make_net()
        grads = MegatronDenseGrads(net)
        for _ in range(2):  # twice: zero_grad must clear the buckets between steps
            grads.zero_grad()
            grads.ddp(rank_input(rank)).pow(2).sum().backward()
            grads.finalize()
        result = [p.grad.clone() for p in net.parameters()]
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            torch.save(gathered, out)
    finally:
        dist.destroy_process_group()


def test_finalize_gives_the_mean_gradient_on_every_rank(tmp_path):
    out = tmp_path / "grads.pt"
    mp.spawn(_rank, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    per_rank = torch.load(out, weights_only=False)
    expected = []
    for rank in range(2):  # by hand: each rank's gradient, then their mean
        net = make_net()
        net(rank_input(rank)).pow(2).sum().backward()
        expected.append([p.grad for p in net.parameters()])
    mean = [(a + b) / 2 for a, b in zip(*expected)]
    for grads in per_rank:
        for got, want in zip(grads, mean):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
