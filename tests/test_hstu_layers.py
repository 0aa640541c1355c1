"""Properties of the HSTU layer that the model relies on."""

import torch

from lightning_hstu.models.hstu_layers import HSTUConfig, HSTUStack, to_padded

CONFIG = HSTUConfig(embedding_dim=16, num_layers=2, num_heads=2, attention_dim=8, hidden_dim=8, max_seq_len=32)


def stack():
    torch.manual_seed(0)
    model = HSTUStack(CONFIG)
    for p in model.parameters():  # non-zero biases, so that they matter in the checks
        torch.nn.init.normal_(p, std=0.2)
    return model


def test_causal_a_position_never_sees_the_future():
    model = stack()
    x = torch.randn(1, 10, 16)
    t = torch.arange(10)[None] * 60
    mask = torch.ones(1, 10, dtype=torch.bool)
    changed = x.clone()
    changed[0, 6:] = torch.randn(4, 16)
    a, b = model(x, mask, t), model(changed, mask, t)
    torch.testing.assert_close(a[0, :6], b[0, :6])
    assert not torch.allclose(a[0, 6:], b[0, 6:])


def test_padding_changes_nothing():
    model = stack()
    lengths = torch.tensor([3, 7])
    values = torch.randn(10, 16)
    times = torch.arange(10) * 30
    x, mask = to_padded(values, lengths)
    t, _ = to_padded(times, lengths)
    x_long, mask_long = to_padded(values, lengths, max_len=12)
    t_long, _ = to_padded(times, lengths, max_len=12)
    short, long = model(x, mask, t), model(x_long, mask_long, t_long)
    torch.testing.assert_close(short[mask], long[mask_long])


def test_each_sequence_is_independent_of_the_others_in_its_batch():
    model = stack()
    values, times = torch.randn(10, 16), torch.arange(10) * 30
    x, mask = to_padded(values, torch.tensor([3, 7]))
    t, _ = to_padded(times, torch.tensor([3, 7]))
    alone_x, alone_mask = to_padded(values[:3], torch.tensor([3]))
    alone_t, _ = to_padded(times[:3], torch.tensor([3]))
    torch.testing.assert_close(model(x, mask, t)[0, :3], model(alone_x, alone_mask, alone_t)[0])


def test_the_time_between_events_matters():
    model = stack()
    x = torch.randn(1, 6, 16)
    mask = torch.ones(1, 6, dtype=torch.bool)
    assert not torch.allclose(model(x, mask, torch.arange(6)[None]), model(x, mask, torch.arange(6)[None] * 10_000))


def test_the_bias_lookup_has_the_gradient_of_plain_indexing():
    from lightning_hstu.models.hstu_layers import lookup_bias

    table = torch.randn(64, requires_grad=True)
    index = torch.randint(0, 64, (4, 30, 30))
    upstream = torch.randn(4, 30, 30)
    (lookup_bias(table, index) * upstream).sum().backward()
    ours = table.grad.clone()
    table.grad = None
    (table[index] * upstream).sum().backward()
    torch.testing.assert_close(ours, table.grad)
    assert torch.equal(lookup_bias(table, index), table[index])


def test_what_graph_capture_records_is_the_method_with_its_parameters_as_arguments():
    """The function that make_graphed_callables captures (graphs._Call): same losses, and the gradients of
    its parameter arguments are the gradients of the module's parameters."""
    from lightning_hstu.hstu.graphs import _Call
    from lightning_hstu.models.hstu import HSTUObjectives

    torch.manual_seed(0)
    objectives = HSTUObjectives(CONFIG, num_actions=5, temperature=0.05)
    B, L, D, K = 3, CONFIG.max_seq_len - 1, CONFIG.embedding_dim, 4
    inputs = (torch.randn(B, L, D, requires_grad=True), torch.randn(B, L, D, requires_grad=True),
              torch.randn(B, D, requires_grad=True), torch.randn(B, K, D, requires_grad=True),
              torch.cumsum(torch.randint(0, 3600, (B, L)), 1), torch.randint(0, 5, (B, L)),
              torch.arange(L)[None] < torch.tensor([[5], [L], [1]]))
    params = tuple(p.detach().clone().requires_grad_() for p in objectives.parameters())
    call = _Call(objectives, "losses", None)
    assert list(call.parameters()) == []
    got = call(*inputs, *params)
    expected = objectives.losses(*inputs)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    sum(got).backward()
    sum(expected).backward()
    for copy, real in zip(params, objectives.parameters()):
        torch.testing.assert_close(copy.grad, real.grad)
