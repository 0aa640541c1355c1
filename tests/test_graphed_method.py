"""GraphedMethod on a GPU: the replayed forward reads the parameters where they live (an in-place update is
seen by the next replay), and the replayed backward adds each parameter's gradient into its accumulator
where one is given (megatron-core's ``main_grad``), or into ``.grad`` where none is; once a parameter's storage
moved, the graphs are dropped: the calls run eagerly (gradients in ``.grad``) until captured again, on the
new storage. The same numbers as the eager method throughout. Token-wise arguments grown to a number of rows
share one graph whatever their own row count, on the GPU and eagerly (grown on the CPU too)."""

import pytest
import torch
from torch import nn

from lightning_hstu.hstu.graphs import GraphedMethod

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Small(nn.Module):
    def __init__(self, bias: bool = True):
        super().__init__()
        self.first, self.second = nn.Linear(6, 5, bias=bias), nn.Linear(5, 1, bias=bias)
        self.rows_seen = []

    def losses(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        self.rows_seen.append(len(x))
        return (self.second(torch.tanh(self.first(x))).square().sum(),)


def twins(device, bias: bool = True):
    torch.manual_seed(0)
    ours = Small(bias).to(device)
    theirs = Small(bias).to(device)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def inputs(step, device, rows: int = 4):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(rows, 6, generator=gen).to(device).requires_grad_()


@cuda
def test_the_replay_accumulates_into_the_given_buffers_and_sees_every_update():
    device = torch.device("cuda")
    ours, theirs = twins(device)
    # the first layer's gradients go to buffers of their own; the second layer's reach .grad
    buffers = {p: torch.zeros_like(p) for p in ours.first.parameters()}
    graphed = GraphedMethod(ours, "losses", warmup=2, accumulators=buffers)
    captures = []
    for step in range(10):
        if graphed.pending():
            assert graphed.capture()
            captures.append(step)
        replays = graphed.replays
        x = inputs(step, device)
        y = x.detach().clone().requires_grad_()
        for buffer in buffers.values():
            buffer.zero_()
        for p in [*ours.parameters(), *theirs.parameters()]:
            p.grad = None
        (loss,) = graphed(x)
        (expected,) = theirs.losses(y)
        replayed = graphed.replays > replays
        loss.backward()
        expected.backward()
        torch.testing.assert_close(loss, expected)
        torch.testing.assert_close(x.grad, y.grad)
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            into_buffer = p in buffers and replayed
            torch.testing.assert_close(buffers[p] if into_buffer else p.grad, q.grad, msg=f"step {step}, {name}")
            if into_buffer:
                assert p.grad is None, f"step {step}: {name}'s gradient went to .grad, not to its buffer"
        with torch.no_grad():  # an optimizer's in-place update, which the next replay must read
            for p, q in zip(ours.parameters(), theirs.parameters()):
                p.sub_(0.1 * q.grad)
                q.sub_(0.1 * q.grad)
        if step == 5:  # a parameter moved to new storage: the graphs no longer read it
            ours.first.weight.data = ours.first.weight.data.clone()
    # eager at 0-1, replays at 2-5, eager at 6-7 (the move found), captured again, replays at 8-9
    assert captures == [2, 8]
    assert (graphed.eager_calls, graphed.replays) == (4, 6)


def replay_beside_eager(graphed, ours, theirs, device, rows_per_step, **call):
    """One step per entry of ``rows_per_step`` (inputs of that many rows), capturing first what is pending:
    the graphed method (``call``: its keyword arguments) and the eager twin on the same inputs, their losses
    and every gradient equal."""
    for step, rows in enumerate(rows_per_step):
        if graphed.pending():
            assert graphed.capture()
        x = inputs(step, device, rows)
        y = x.detach().clone().requires_grad_()
        for p in [*ours.parameters(), *theirs.parameters()]:
            p.grad = None
        (loss,) = graphed(x, **call)
        (expected,) = theirs.losses(y)
        loss.backward()
        expected.backward()
        torch.testing.assert_close(loss, expected, msg=f"step {step}")
        torch.testing.assert_close(x.grad, y.grad, msg=f"step {step}")
        for p, q in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=f"step {step}")


ROWS = [3, 5, 8, 2, 7, 4, 1, 8]
"""Row counts of the grown argument, each call's; zero rows add nothing to the bias-free ``Small``'s loss."""


def test_grown_arguments_reach_the_method_with_zero_rows_and_their_gradients_with_their_own_rows():
    """Eagerly (here on the CPU): the method sees the argument grown to ``rows``, and the caller gets the
    gradient of its own rows; more rows than ``rows`` are refused, naming the argument."""
    ours, theirs = twins("cpu", bias=False)
    graphed = GraphedMethod(ours, "losses")
    for step, rows in enumerate(ROWS):
        x = inputs(step, "cpu", rows)
        y = x.detach().clone().requires_grad_()
        (loss,) = graphed(x, rows=8, grown=(0,))
        (expected,) = theirs.losses(y)
        loss.backward()
        expected.backward()
        torch.testing.assert_close(loss, expected)
        torch.testing.assert_close(x.grad, y.grad)
    assert ours.rows_seen == [8] * len(ROWS)
    with pytest.raises(ValueError, match="argument 0 has 9 rows, more than rows=8"):
        graphed(inputs(0, "cpu", 9), rows=8, grown=(0,))


@cuda
def test_grown_arguments_share_one_graph_and_a_replay_zeros_the_rows_an_earlier_call_left():
    """Calls of 1 to 8 rows grown to 8 share one signature: 2 eager calls, one capture, 6 replays; a replay
    after a longer call (8 rows, then 2) must zero the rows past its own, or the loss and the gradients
    would differ from the eager method's."""
    device = torch.device("cuda")
    ours, theirs = twins(device, bias=False)
    graphed = GraphedMethod(ours, "losses", warmup=2)
    replay_beside_eager(graphed, ours, theirs, device, ROWS, rows=8, grown=(0,))
    assert (graphed.eager_calls, graphed.replays, len(graphed.graphs)) == (2, 6, 1)


@cuda
def test_the_graphs_of_several_signatures_share_one_pool_and_replay_in_any_order():
    """Calls of 4 and of 8 rows (not grown: two signatures) captured into one memory pool, where each
    signature's graphs reuse the other's buffers, then replayed in turns and in runs: the same losses and
    gradients as the eager method at every step."""
    device = torch.device("cuda")
    ours, theirs = twins(device)
    graphed = GraphedMethod(ours, "losses", warmup=1)
    replay_beside_eager(graphed, ours, theirs, device, [4, 8, 4, 4, 8, 8, 4, 8])
    assert (graphed.eager_calls, graphed.replays, len(graphed.graphs)) == (2, 6, 2)
