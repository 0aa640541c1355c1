"""GraphedAdamW: AdamW on the CPU; on a GPU, its step captured once the gradients stay put and replayed,
with the updates of plain AdamW, the learning rate an LR scheduler sets, and eager steps where the
gradients are not the captured ones."""

import pytest
import torch

from lightning_hstu.hstu.graphs import GraphedAdamW

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def parameters(device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen).to(device)) for shape in [(7, 5), (5,), (3, 3)]]


def gradient_steps(steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=gen) for shape in [(7, 5), (5,), (3, 3)]] for _ in range(steps)]


def test_on_the_cpu_it_is_adamw_and_never_asks_to_be_captured():
    ours, theirs = parameters("cpu"), parameters("cpu")
    graphed = GraphedAdamW(ours, lr=0.01, weight_decay=0.1, betas=(0.9, 0.98))
    plain = torch.optim.AdamW(theirs, lr=0.01, weight_decay=0.1, betas=(0.9, 0.98))
    for grads in gradient_steps(6):
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        graphed.step()
        plain.step()
        assert graphed.pending() == []
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)


SCHEDULES = {
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10),  # lr_schedule="cosine"'s
}


@cuda
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_the_replayed_step_updates_like_adamw_with_the_schedulers_learning_rate(schedule, fused):
    """Both implementations captured (HSTURecommender's is the fused one, ``dense_adamw``), against torch's
    default AdamW stepping eagerly."""
    device = torch.device("cuda")
    ours, theirs = parameters(device), parameters(device)
    graphed = GraphedAdamW(ours, lr=0.01, weight_decay=0.1, betas=(0.9, 0.98), fused=fused)
    plain = torch.optim.AdamW(theirs, lr=0.01, weight_decay=0.1, betas=(0.9, 0.98))
    schedules = [SCHEDULES[schedule](o) for o in (graphed, plain)]
    buffers = [torch.zeros_like(p) for p in ours]  # gradients that stay put, as megatron-core's do
    for step, grads in enumerate(gradient_steps(10)):
        if step == 3:
            assert graphed.pending() == ["step"]
            assert graphed.capture() == ["AdamW step over 3 parameters"]
        for p, q, buffer, g in zip(ours, theirs, buffers, grads):
            buffer.copy_(g)
            p.grad, q.grad = buffer, g.to(device)
        if step == 6:
            ours[1].grad = theirs[1].grad = None  # a parameter without a gradient: this step runs eagerly
        graphed.step()
        plain.step()
        for schedule in schedules:
            schedule.step()
        ours[1].grad = buffers[1]
    assert (graphed.eager_steps, graphed.replays) == (4, 6)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
