"""finalize_model_grads (megatron-core) gives every rank the all-reduced mean gradient of the dense part."""

import torch
from torch import nn

from ranks import run_on_ranks

from lightning_hstu.hstu.dense_grads import MegatronDenseGrads


def make_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.SiLU(), nn.Linear(8, 1))


def rank_input(rank):
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))


def _two_steps(rank, world):
    net = make_net()
    grads = MegatronDenseGrads(net)
    for _ in range(2):  # twice: zero_grad must clear the buckets between steps
        grads.zero_grad()
        grads.ddp(rank_input(rank)).pow(2).sum().backward()
        grads.finalize()
    return [p.grad.clone() for p in net.parameters()]


def test_finalize_gives_the_mean_gradient_on_every_rank(tmp_path):
    per_rank = run_on_ranks(_two_steps, tmp_path)
    expected = []
    for rank in range(2):  # by hand: each rank's gradient, then their mean
        net = make_net()
        net(rank_input(rank)).pow(2).sum().backward()
        expected.append([p.grad for p in net.parameters()])
    mean = [(a + b) / 2 for a, b in zip(*expected)]
    for grads in per_rank:
        for got, want in zip(grads, mean):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
