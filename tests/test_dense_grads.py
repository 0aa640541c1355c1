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


def _one_rank_steps(rank, world):
    net = make_net()
    grads = MegatronDenseGrads(net)
    addresses = []
    for _ in range(2):
        grads.zero_grad()
        grads.ddp(rank_input(0)).pow(2).sum().backward()
        grads.finalize()
        addresses.append([p.grad.data_ptr() for p in net.parameters()])
    return [p.grad.clone() for p in net.parameters()], addresses


def test_one_rank_gets_its_own_gradient_in_fixed_buffers(tmp_path):
    """One rank (nothing to all-reduce): the second step's gradients are the plain gradient of that step
    (the buffers were cleared), and they lie at the same addresses in both steps (megatron's buffers, which
    a captured optimizer step reads)."""
    [(grads, addresses)] = run_on_ranks(_one_rank_steps, tmp_path, world=1)
    net = make_net()
    net(rank_input(0)).pow(2).sum().backward()
    for got, want in zip(grads, [p.grad for p in net.parameters()]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert addresses[0] == addresses[1]
