"""Properties of the HSTU layer that the model relies on."""

import dataclasses

import pytest
import torch
from torch.nn import functional as F

from small_hstu import lengths_apart

from lightning_hstu.models.hstu_layers import HSTUConfig, HSTUStack, Padding, to_padded

CONFIG = HSTUConfig(
    embedding_dim=16,
    num_layers=2,
    num_heads=2,
    attention_dim=8,
    hidden_dim=8,
    max_seq_len=32,
    position_embedding=True,
    scale_inputs=True,
)


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


@pytest.mark.parametrize("autocast_residual", [True, False])
def test_under_autocast_the_residual_stream_is_in_autocasts_dtype_unless_kept_in_float32(autocast_residual):
    """What each layer's norm and the final norm read (the residual stream) under bf16 autocast: bf16 from the
    first layer on, or float32 with ``autocast_residual=False``; the output and the input's gradient stay
    float32 either way."""
    torch.manual_seed(0)
    model = HSTUStack(dataclasses.replace(CONFIG, autocast_residual=autocast_residual))
    read = []
    for norm in [layer.norm for layer in model.layers] + [model.norm]:
        norm.register_forward_pre_hook(lambda module, args: read.append(args[0].dtype))
    x = torch.randn(2, 6, 16, requires_grad=True)
    mask = torch.ones(2, 6, dtype=torch.bool)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, mask, torch.arange(6)[None].expand(2, 6) * 60)
    assert read == [torch.bfloat16 if autocast_residual else torch.float32] * (CONFIG.num_layers + 1)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert x.grad.dtype == torch.float32 and x.grad.abs().sum() > 0


def test_without_autocast_the_residual_option_changes_nothing():
    in_autocast_dtype = stack()  # autocast_residual=True, the default
    in_float32 = HSTUStack(dataclasses.replace(CONFIG, autocast_residual=False))
    in_float32.load_state_dict(in_autocast_dtype.state_dict())
    x, mask = torch.randn(2, 6, 16), torch.ones(2, 6, dtype=torch.bool)
    t = torch.arange(6)[None].expand(2, 6) * 60
    assert torch.equal(in_autocast_dtype(x, mask, t), in_float32(x, mask, t))


@pytest.mark.parametrize("autocast", [False, True])
def test_a_linear_map_with_its_bias_in_the_weight_product_equals_f_linear(autocast):
    """``_BiasInProduct`` (the compiled layers' linear maps): the output and the gradients of the input, the weight
    and the bias are ``F.linear``'s, the bias's gradient read from the weight gradient's product; under bf16
    autocast both compute in bf16 and agree to its precision, the gradients in the inputs' dtypes."""
    from lightning_hstu.models.hstu_layers import _BiasInProduct

    torch.manual_seed(0)
    x = torch.randn(37, 24, requires_grad=True)
    weight, bias = torch.randn(40, 24, requires_grad=True), torch.randn(40, requires_grad=True)
    dy = torch.randn(37, 40)

    def run(linear):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = linear(x, weight, bias)
        return (out, *torch.autograd.grad(out, (x, weight, bias), dy.to(out.dtype)))

    expected, got = run(F.linear), run(_BiasInProduct.apply)
    tolerance = {"rtol": 2e-2, "atol": 5e-2} if autocast else {"rtol": 1e-5, "atol": 1e-5}
    assert got[0].dtype == expected[0].dtype == (torch.bfloat16 if autocast else torch.float32)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g.float(), e.float(), **tolerance)
    torch.testing.assert_close(got[3], dy.sum(0), **tolerance)  # the bias's gradient: the column sums


@pytest.mark.parametrize("autocast", [False, True])
def test_the_compiled_layer_boundary_and_output_equal_the_eager_ones(autocast):
    """The compiled ``_layer_boundary`` and ``_stack_output`` (the fused attention's path on CUDA) give the eager
    functions' outputs and gradients (residual stream, attention output, U, every norm's and linear map's
    parameters, f1's and f2's biases among them) on jagged tokens, in float32 and under bf16 autocast."""
    from lightning_hstu.models.hstu_layers import _compiled_token_wise, _layer_boundary, _stack_output

    torch.manual_seed(0)
    model = HSTUStack(CONFIG)
    first, second = model.layers[0], model.layers[1]
    width = CONFIG.num_heads * CONFIG.hidden_dim
    x = torch.randn(11, CONFIG.embedding_dim, requires_grad=True)
    y, u = torch.randn(11, width, requires_grad=True), torch.randn(11, width, requires_grad=True)
    parts = first.attention_norm, first.f2, first.dropout
    weights = [x, y, u, *first.attention_norm.parameters(), *first.f2.parameters()]
    weights += [*second.norm.parameters(), *second.f1.parameters(), *model.norm.parameters()]

    def run(boundary, output):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            residual, projected = boundary(*parts, x, y, u, None, second.norm, second.f1, False)
            out = output(*parts, residual, y, u, None, model.norm, True)
        loss = out.float().square().sum() + projected.float().sin().sum() + residual.float().cos().sum()
        return [residual, projected, out, *torch.autograd.grad(loss, weights)]

    _, boundary, output = _compiled_token_wise()
    expected, got = run(_layer_boundary, _stack_output), run(boundary, output)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype
        if autocast:
            torch.testing.assert_close(g.float(), e.float(), rtol=5e-2, atol=5e-2 * e.abs().max().item())
        else:
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("padded", [False, True])
def test_the_compiled_stack_entry_equals_the_eager_one(padded):
    """``compile_layers`` on CUDA compiles the stack's input and the first layer's inputs as one function
    (``_stack_entry``, the first of ``_compiled_token_wise``). Here on the CPU: in float32 the compiled
    function gives the eager one's residual stream, projection and every gradient (the input's, the position
    table's, the norm's, f1's), with the inputs scaled and a padding mask; under bf16 autocast both give the
    residual stream in bf16 (``autocast_residual``) and agree to bf16's precision."""
    from lightning_hstu.models.hstu_layers import _compiled_token_wise, _stack_entry

    torch.manual_seed(0)
    model = HSTUStack(dataclasses.replace(CONFIG, position_embedding=True, scale_inputs=True))
    shape = (2, 5, 16) if padded else (10, 16)
    x = torch.randn(shape, requires_grad=True)
    positions = torch.arange(5).expand(2, 5) if padded else torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4, 5])
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2]) if padded else None
    first = model.layers[0]
    weights = (x, model.position.weight, first.norm.weight, first.norm.bias, first.f1.weight, first.f1.bias)

    def run(entry, autocast):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            residual, projected = entry(model, x, positions, mask, first.norm, first.f1)
        grads = torch.autograd.grad((residual.float().square().sum() + projected.float().sin().sum()), weights)
        return residual, projected, grads

    residual, projected, grads = run(_stack_entry, False)
    got_residual, got_projected, got_grads = run(_compiled_token_wise()[0], False)
    torch.testing.assert_close(got_residual, residual, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_projected, projected, rtol=1e-5, atol=1e-6)
    for got, expected in zip(got_grads, grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    if padded:  # the padding is zero in the residual stream
        assert got_residual[1, 3:].abs().sum() == 0 and residual[1, 3:].abs().sum() == 0

    residual, projected, grads = run(_stack_entry, True)
    got_residual, got_projected, got_grads = run(_compiled_token_wise()[0], True)
    assert residual.dtype == got_residual.dtype == torch.bfloat16
    torch.testing.assert_close(got_residual, residual, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got_projected, projected, rtol=2e-2, atol=2e-2)
    for got, expected in zip(got_grads, grads):
        torch.testing.assert_close(got, expected, rtol=5e-2, atol=5e-2 * expected.abs().max().item())


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
    """The function that the graphs capture (graphs._Call): same losses, and the gradients of
    its parameter arguments are the gradients of the module's parameters."""
    from lightning_hstu.hstu.graphs import _Call
    from lightning_hstu.models.hstu import HSTUObjectives

    torch.manual_seed(0)
    objectives = HSTUObjectives(CONFIG, num_actions=5, temperature=0.05)
    B, L, D, K = 3, CONFIG.max_seq_len - 1, CONFIG.embedding_dim, 4
    inputs = (
        torch.randn(B, L, D, requires_grad=True),
        torch.randn(B, L, D, requires_grad=True),
        torch.randn(B, D, requires_grad=True),
        torch.randn(B, K, D, requires_grad=True),
        torch.cumsum(torch.randint(0, 3600, (B, L)), 1),
        torch.randint(0, 5, (B, L)),
        torch.randint(1, 50, (B, L)),
        torch.randint(1, 50, (B, K)),
        torch.arange(L)[None] < torch.tensor([[5], [L], [1]]),
    )
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


def jagged_histories(lengths, seed=0):
    """Tokens of several histories back to back (with a history of one token), and their times."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    values = torch.randn(int(lengths.sum()), CONFIG.embedding_dim, generator=gen)
    times = torch.cumsum(torch.randint(0, 5000, (len(values),), generator=gen), 0)
    return values, times, lengths


INTERPRETER_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CPU tensors through Triton's interpreter, which conftest.py turns on only without a GPU; on a GPU "
    "test_hstu_cuda.py trains the fused stack against the padded one",
)


JAGGED_ATTENTIONS = [pytest.param("fused", marks=INTERPRETER_ONLY), "grouped"]
"""The jagged layout's two attentions: the fused kernel (Triton's interpreter on the CPU) and the padded
reference's over groups of like lengths (``lengths_apart``: a group per length)."""


@pytest.mark.parametrize("attention", [*JAGGED_ATTENTIONS, "grouped apart"])
@pytest.mark.parametrize("lengths", [[1, 32, 9, 20], [5, 5, 5], [32, 31, 1, 1, 2, 30, 17, 16, 1]])
def test_the_jagged_stack_computes_what_the_padded_stack_does(monkeypatch, attention, lengths):
    """The same hidden states and gradients as the padded stack, with rows of one token and of the longest
    length; grouped: in one group, and in groups of one and of several histories, of equal and unequal
    lengths, in an order other than the batch's."""
    made = lengths_apart(monkeypatch) if attention == "grouped apart" else None
    model = stack()
    values, times, lengths = jagged_histories(lengths)
    x, mask = to_padded(values, lengths)
    t, _ = to_padded(times, lengths)
    offsets = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0))
    padded = model(x, mask, t)[mask]
    weights = torch.randn_like(padded)
    (padded * weights).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    jagged = model.jagged(values, offsets, times, grouped=attention != "fused")
    (jagged * weights).sum().backward()
    torch.testing.assert_close(jagged, padded, rtol=1e-5, atol=1e-5)
    for got, want in zip((p.grad for p in model.parameters()), expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    if made is not None:
        assert made == [len(set(lengths.tolist()))]


def test_the_length_groups_cost_least_and_cover_every_history_once():
    """Every partition of the sorted lengths into runs costs at least what ``length_groups`` returns (checked
    against all 2^(n-1) of them); each history is in exactly one group, the longest first in each, also in a
    batch of thousands, where only ``cuts`` places are tried."""
    import itertools

    from lightning_hstu.models.hstu_layers import length_groups

    def cost(groups, lengths, overhead):
        return sum(len(g) * max(lengths[i] for i in g) ** 2 + overhead for g in groups)

    gen = torch.Generator().manual_seed(0)
    for overhead in (0, 300, 10**9):
        for _ in range(20):
            lengths = torch.randint(1, 60, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
            groups = length_groups(lengths, overhead)
            assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
            assert all(lengths[g[0]] == max(lengths[i] for i in g) for g in groups)
            order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
            least = min(
                cost([order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))], lengths, overhead)
                for k in range(len(order))
                for cuts in itertools.combinations(range(1, len(order)), k)
            )
            assert cost(groups, lengths, overhead) == least
    assert length_groups([7, 3, 7], 10**9) == [[0, 2, 1]]  # one group where a second costs more than padding
    assert length_groups([7, 3, 7], 1) == [[0, 2], [1]]
    assert length_groups([5, 5, 5], 0) == [[0, 1, 2]]  # equal lengths never split
    assert length_groups([], 0) == []
    many = torch.randint(1, 200, (4096,), generator=gen).tolist()  # more places to cut than ``cuts``
    for groups in (length_groups(many), length_groups(many, 0, cuts=3)):
        assert sorted(i for g in groups for i in g) == list(range(len(many)))
        assert all(many[g[0]] == max(many[i] for i in g) for g in groups)
    assert len(length_groups(many, 0, cuts=3)) <= 4


ITEMS = 12
"""Item ids of the loss tests: few, so that negatives often hit a target."""


def objectives_and_inputs(attention, retrieval="sampled", history_logit=False):
    from lightning_hstu.models.hstu import HSTUObjectives

    torch.manual_seed(0)
    objectives = HSTUObjectives(
        CONFIG,
        num_actions=5,
        temperature=0.05,
        attention=attention,
        retrieval=retrieval,
        ranking_weight=0.5,
        history_logit=history_logit,
    )
    for p in objectives.parameters():
        torch.nn.init.normal_(p, std=0.2)
    gen = torch.Generator().manual_seed(1)
    lengths = torch.tensor([1, CONFIG.max_seq_len - 1, 7, 0, 3])  # an empty history and a full one
    n, batch, width = int(lengths.sum()), len(lengths), CONFIG.embedding_dim
    negatives = {"sampled": (batch, 4), "full": (ITEMS + 1,), "in_batch": (0,)}[retrieval]
    leaves = [
        torch.randn(n, width, generator=gen),
        torch.randn(n, width, generator=gen),
        torch.randn(batch, width, generator=gen),
        torch.randn(*negatives, width, generator=gen),
    ]
    times = torch.cumsum(torch.randint(0, 5000, (n,), generator=gen), 0)
    actions = torch.randint(0, 5, (n,), generator=gen)
    ids = dict(
        targets=torch.randint(1, ITEMS + 1, (n,), generator=gen),
        negatives=(
            torch.arange(ITEMS + 1) if retrieval == "full" else torch.randint(1, ITEMS + 1, negatives, generator=gen)
        ),
    )
    return objectives, [t.requires_grad_() for t in leaves], times, actions, ids, lengths


def losses_and_gradients(objectives, inputs, leaves):
    retrieval, ranking = objectives.losses(*inputs)
    (retrieval + 2 * ranking).backward()
    return [retrieval.detach(), ranking.detach(), *(t.grad for t in leaves), *(p.grad for p in objectives.parameters())]


def padded_losses(retrieval, history_logit=False):
    from lightning_hstu.models.hstu import DenseInputs

    objectives, leaves, times, actions, ids, lengths = objectives_and_inputs("padded", retrieval, history_logit)
    padding = Padding(lengths, len(times), CONFIG.max_seq_len - 1)
    events, targets, user, negatives = leaves
    inputs = DenseInputs(
        padding(events),
        padding(targets),
        user,
        negatives,
        padding(times),
        padding(actions),
        padding(ids["targets"]),
        ids["negatives"],
        padding.mask,
    )
    return objectives, inputs, leaves


def test_the_jagged_layout_puts_each_row_once_and_returns_each_rows_gradient():
    """``JaggedLayout.tokens``: each history's user row, then its events, histories one after another (an empty
    one keeps its user token), the rows past the real events last; float rows get the gradient that plain
    indexing gives them, integer rows (the times) come out alike."""
    from lightning_hstu.models.hstu import JaggedLayout

    lengths, capacity = torch.tensor([2, 0, 3]), 7  # 5 real events, 2 rows past them
    layout = JaggedLayout(lengths, capacity)
    user = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    events = torch.randn(capacity, 4, dtype=torch.float64, requires_grad=True)
    tokens = layout.tokens(user, events)
    order = [("u", 0), ("e", 0), ("e", 1), ("u", 1), ("u", 2), ("e", 2), ("e", 3), ("e", 4), ("e", 5), ("e", 6)]
    expected = torch.stack([user[i] if kind == "u" else events[i] for kind, i in order])
    assert torch.equal(tokens, expected)
    grad = torch.randn_like(tokens)
    assert all(
        torch.equal(got, want)
        for got, want in zip(
            torch.autograd.grad(tokens, (user, events), grad), torch.autograd.grad(expected, (user, events), grad)
        )
    )
    assert torch.autograd.gradcheck(lambda u, e: layout.tokens(u, e), (user, events))
    times = torch.arange(10, 10 + capacity)
    assert layout.tokens(layout.user_times(times), times).tolist() == [10, 10, 11, 0, 12, 12, 13, 14, 15, 16]


def jagged_losses(retrieval, history_logit=False, extra_rows=0, attention="fused"):
    """``padded_losses``' histories in the jagged layout, with ``extra_rows`` past the real events."""
    from lightning_hstu.models.hstu import JaggedInputs

    objectives, leaves, times, actions, ids, lengths = objectives_and_inputs(attention, retrieval, history_logit)
    events, targets, user, negatives = leaves
    grow = lambda t: torch.cat([t, t.new_zeros((extra_rows, *t.shape[1:]))])  # noqa: E731
    inputs = JaggedInputs(
        grow(events),
        grow(targets),
        user,
        negatives,
        grow(times),
        grow(actions),
        grow(ids["targets"]),
        ids["negatives"],
        lengths,
    )
    return objectives, inputs, leaves


@pytest.mark.parametrize("attention", JAGGED_ATTENTIONS)
@pytest.mark.parametrize(
    "retrieval, extra_rows, history_logit",
    [("sampled", 0, False), ("sampled", 9, False), ("full", 9, False), ("in_batch", 9, False)]
    + [("sampled", 9, True), ("full", 0, True), ("full", 9, True), ("in_batch", 9, True)],
)
def test_the_jagged_losses_equal_the_padded_losses(monkeypatch, retrieval, extra_rows, history_logit, attention):
    """Both layouts of HSTUObjectives.losses on the same histories, for each retrieval loss, also with a
    token capacity (rows past the real events, as graph capture uses), and with the history logit (its
    gradient included: it is among the objectives' parameters); grouped, a group per length."""
    made = lengths_apart(monkeypatch)
    expected = losses_and_gradients(*padded_losses(retrieval, history_logit))
    got = losses_and_gradients(*jagged_losses(retrieval, history_logit, extra_rows, attention))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
    assert made == ([5] if attention == "grouped" else [])  # the five histories' lengths all differ


def retrieval_by_hand(objectives, inputs, negatives_of):
    """Sum over real positions of -log softmax of the target among (target, negatives_of(sample, target)),
    from the encoded states: the definition the loss implements."""
    hidden = objectives.encode(inputs.events, inputs.user, inputs.times, inputs.mask)[:, :-1]
    total = 0.0
    for b, position in inputs.mask.nonzero().tolist():
        query = torch.nn.functional.normalize(hidden[b, position], dim=-1)
        target = int(inputs.target_ids[b, position])
        rows = torch.cat([inputs.targets[b, position][None], negatives_of(b, target)])
        logits = torch.nn.functional.normalize(rows, dim=-1) @ query / objectives.temperature
        total = total - torch.log_softmax(logits, 0)[0]
    return total


@pytest.mark.parametrize("retrieval", ["full", "sampled"])
def test_the_history_logit_is_added_to_the_items_a_position_has_read(retrieval):
    """With the history logit on, each position's softmax adds it (over the temperature) to every scored item
    that an earlier event of its history holds, the target included when the history holds it already; the
    item ids are few (12), so histories repeat items."""
    objectives, inputs, _ = padded_losses(retrieval, history_logit=True)
    logit = objectives.history_logit
    assert logit.item() != 0

    def held(b, position, ids):
        return torch.isin(ids, inputs.target_ids[b, :position]).float() * logit / objectives.temperature

    hidden = objectives.encode(inputs.events, inputs.user, inputs.times, inputs.mask)[:, :-1]
    total, repeats = 0.0, 0
    for b, position in inputs.mask.nonzero().tolist():
        query = torch.nn.functional.normalize(hidden[b, position], dim=-1)
        target = inputs.target_ids[b, position]
        repeats += bool(torch.isin(target, inputs.target_ids[b, :position]))
        if retrieval == "full":
            ids = torch.arange(1, ITEMS + 1)
            rows, at = inputs.negatives[1:], int(target) - 1
        else:
            kept = inputs.negative_ids[b] != target
            ids = torch.cat([target[None], inputs.negative_ids[b][kept]])
            rows, at = torch.cat([inputs.targets[b, position][None], inputs.negatives[b][kept]]), 0
        logits = torch.nn.functional.normalize(rows, dim=-1) @ query / objectives.temperature + held(b, position, ids)
        total = total - torch.log_softmax(logits, 0)[at]
    assert repeats > 0  # some targets are held already: their own logit counts
    retrieval_loss, _ = objectives.losses(*inputs)
    torch.testing.assert_close(retrieval_loss, total)
    weights = [p for p in objectives.parameters() if p.requires_grad]
    got = torch.autograd.grad(retrieval_loss, weights, allow_unused=True, materialize_grads=True)
    expected = torch.autograd.grad(total, weights, allow_unused=True, materialize_grads=True)
    for g, e in zip(got, expected):  # the logit's own gradient among them
        torch.testing.assert_close(g, e)


def test_the_catalogue_pairs_are_what_the_history_holds_over_every_column():
    """``catalogue_pairs`` of the real queries of histories that repeat items (each pair once), empty ones and
    padding: the True entries of ``holds`` over the whole catalogue (column c is item c + 1)."""
    from lightning_hstu.models.hstu import HistoryItems

    gen = torch.Generator().manual_seed(0)
    batch, length, width = 6, 9, 7
    lengths = torch.tensor([0, length, 4, 1, 0, 6])
    real = torch.arange(length) < lengths[:, None]
    target_ids = torch.randint(1, width, (batch, length), generator=gen)  # 6 items over 20 events: repeats
    sample = torch.arange(batch)[:, None].expand(batch, length)
    position = torch.arange(length)[None, :].expand(batch, length)
    history = HistoryItems(target_ids, sample, position, real, batch, width, table=True)
    query_sample, query_position = sample[real], position[real]
    rows, columns = history.catalogue_pairs(query_sample)
    got = torch.zeros(len(query_sample), width - 1, dtype=torch.bool)
    got[rows, columns] = True
    expected = history.holds(query_sample, query_position, torch.arange(1, width))
    assert torch.equal(got, expected) and expected.sum() > 10
    assert len(set(zip(rows.tolist(), columns.tolist()))) == len(rows)  # no pair twice


def test_on_histories_that_never_return_to_an_item_the_history_logit_is_pushed_down():
    """Where no target is ever an item its history holds (MovieLens), the retrieval loss grows with the
    history logit: gradient descent makes it negative, so the history's own items stop scoring first."""
    objectives, inputs, _ = padded_losses("full", history_logit=True)
    mask = inputs.mask & (torch.arange(inputs.mask.shape[1]) < ITEMS)  # histories of at most ITEMS events
    unique = (torch.arange(inputs.mask.shape[1]) % ITEMS + 1).expand_as(mask) * mask  # each of its items once
    assert all(len(set(row[m].tolist())) == int(m.sum()) > 0 for row, m in zip(unique, mask) if m.any())
    retrieval, _ = objectives.losses(*inputs._replace(target_ids=unique, mask=mask))
    (gradient,) = torch.autograd.grad(retrieval, objectives.history_logit)
    assert gradient.item() > 0


def test_the_history_logit_shifts_the_ranking_scores_of_the_history_items_only():
    from torchrec.sparse.jagged_tensor import JaggedTensor

    objectives, _, _ = padded_losses("full", history_logit=True)
    scores = torch.randn(3, ITEMS + 1)
    history = JaggedTensor(values=torch.tensor([2, 5, 5, 7, 1]), lengths=torch.tensor([3, 0, 2]))
    shifted = objectives.with_history_logit(scores, history) - scores
    expected = torch.zeros_like(scores)
    expected[0, [2, 5]] = expected[2, [7, 1]] = objectives.history_logit.item()
    torch.testing.assert_close(shifted, expected)


def histories_held(target_ids, real, sample, position, ids):
    """[Q, K] by definition: whether a real target of query q's sample, before its position, is ids[q, k]."""
    held = torch.zeros(ids.shape, dtype=torch.bool)
    for q, (b, p) in enumerate(zip(sample.tolist(), position.tolist())):
        before = target_ids[b, :p][real[b, :p]]
        held[q] = torch.isin(ids[q], before)
    return held


@pytest.mark.parametrize("seed", range(3))
def test_the_sorted_history_items_hold_what_the_table_holds(seed):
    """HistoryItems' two representations answer every query the same, and as the definition: histories that
    repeat items, empty ones, padding (ids there are ignored), ids 0 and width - 1, queries at position 0
    and past the end."""
    from lightning_hstu.models.hstu import HistoryItems

    gen = torch.Generator().manual_seed(seed)
    batch, length, width = 6, 9, 7
    lengths = torch.tensor([0, length, 4, 1, 0, 6])
    real = torch.arange(length) < lengths[:, None]
    target_ids = torch.randint(0, width, (batch, length), generator=gen)  # few ids: repeats, 0 and 6
    sample = torch.arange(batch)[:, None].expand(batch, length)
    position = torch.arange(length)[None, :].expand(batch, length)
    built = [HistoryItems(target_ids, sample, position, real, batch, width, table) for table in (True, False)]
    assert [h.dense for h in built] == [True, False]
    queries = 200
    query_sample = torch.randint(0, batch, (queries,), generator=gen)
    query_position = torch.randint(0, length + 3, (queries,), generator=gen)  # 0 .. past the end
    query_ids = torch.randint(0, width, (queries, 5), generator=gen)
    query_ids[:, -1] = torch.tensor([0, width - 1]).repeat(queries // 2)
    expected = histories_held(target_ids, real, query_sample, query_position, query_ids)
    assert expected.any() and not expected.all()
    for history in built:
        assert torch.equal(history.holds(query_sample, query_position, query_ids), expected)
    every = torch.arange(width).expand(queries, width)  # the full softmax's columns
    assert torch.equal(
        built[1].holds(query_sample, query_position, every), built[0].holds(query_sample, query_position, every)
    )


@pytest.mark.parametrize("retrieval", ["sampled", "in_batch"])
@pytest.mark.parametrize("layout", ["padded", pytest.param("fused", marks=INTERPRETER_ONLY), "grouped"])
def test_the_history_logit_losses_are_the_same_from_the_sorted_history_items(monkeypatch, retrieval, layout):
    """With the table's size limit at 0 (a catalogue too large for it), the losses and all gradients are
    the table's, in both layouts (the jagged one with rows past the real events)."""
    from lightning_hstu.models import hstu

    losses = padded_losses if layout == "padded" else lambda *a: jagged_losses(*a, extra_rows=9, attention=layout)
    expected = losses_and_gradients(*losses(retrieval, True))
    monkeypatch.setattr(hstu, "HISTORY_TABLE_ENTRIES", 0)
    sort, sorts = hstu.HistoryItems._sorted, []

    def counted(*args):
        sorts.append(args)
        return sort(*args)

    monkeypatch.setattr(hstu.HistoryItems, "_sorted", staticmethod(counted))
    got = losses_and_gradients(*losses(retrieval, True))
    assert sorts  # the sort answered
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_a_catalogue_of_fifty_million_items_is_sorted_not_tabled():
    """A batch of 64 over 50M items (a 12.8 GB table) sorts its targets instead and holds the right items;
    a size whose keys overflow int64 is an error that names it."""
    from lightning_hstu.models.hstu import HistoryItems

    batch, length, width = 64, 20, 50_000_000
    gen = torch.Generator().manual_seed(0)
    target_ids = torch.randint(1, width, (batch, length), generator=gen)
    target_ids[0, :3] = torch.tensor([width - 1, 0, width - 1])
    target_ids[1, 5] = 123
    real = torch.ones(batch, length, dtype=torch.bool)
    real[1, 5:] = False  # item 123 at padding: never held
    sample = torch.arange(batch)[:, None].expand(batch, length)
    position = torch.arange(length)[None, :].expand(batch, length)
    history = HistoryItems(target_ids, sample, position, real, batch, width)
    assert not history.dense
    ids = torch.tensor([width - 1, 0, 123, int(target_ids[63, 19]), int(target_ids[2, 7])])
    query_sample, query_position = torch.tensor([0, 0, 1, 63, 63, 2]), torch.tensor([1, 0, 20, 19, 20, 8])
    expected = histories_held(target_ids, real, query_sample, query_position, ids.expand(6, 5))
    assert torch.equal(history.holds(query_sample, query_position, ids), expected)
    assert expected[0].tolist() == [True, False, False, False, False]  # [0, 1): item width - 1 only
    assert expected[4, 3] and not expected[3, 3]  # the last target, held after its position only
    assert not expected[2, 2]  # item 123 at padding
    with pytest.raises(ValueError, match=f"batch=4096 times width={2**50} times 21 positions"):
        HistoryItems(target_ids[:1], sample[:1], position[:1], real[:1], 4096, 2**50)


def test_sampled_negatives_that_hit_the_target_are_left_out():
    objectives, inputs, _ = padded_losses("sampled")
    assert (inputs.negative_ids[:, None, :] == inputs.target_ids[..., None])[inputs.mask].any()  # hits exist

    def kept(b, target):
        return inputs.negatives[b][inputs.negative_ids[b] != target]

    retrieval, _ = objectives.losses(*inputs)
    torch.testing.assert_close(retrieval, retrieval_by_hand(objectives, inputs, kept))
    unmasked, _ = objectives.losses(*inputs._replace(negative_ids=inputs.negative_ids + 100))  # no hit possible
    assert not torch.allclose(unmasked, retrieval)


def test_the_full_softmax_is_the_cross_entropy_over_every_item():
    objectives, inputs, _ = padded_losses("full")
    table = inputs.negatives

    def every_other_item(b, target):
        return table[(torch.arange(len(table)) != target) & (torch.arange(len(table)) != 0)]

    # the target's own row stands for it: its score is the target's in the table
    inputs = inputs._replace(targets=table[inputs.target_ids])
    retrieval, _ = objectives.losses(*inputs)
    torch.testing.assert_close(retrieval, retrieval_by_hand(objectives, inputs, every_other_item))


def test_in_batch_negatives_are_the_other_targets_of_the_batch():
    objectives, inputs, _ = padded_losses("in_batch")
    real_targets, real_ids = inputs.targets[inputs.mask], inputs.target_ids[inputs.mask]

    def other_targets(b, target):
        return real_targets[real_ids != target]

    retrieval, _ = objectives.losses(*inputs)
    torch.testing.assert_close(retrieval, retrieval_by_hand(objectives, inputs, other_targets))


def test_a_zero_ranking_weight_drops_the_ranking_loss_and_its_head():
    from lightning_hstu.models.hstu import HSTUObjectives

    objectives = HSTUObjectives(CONFIG, num_actions=5, temperature=0.05, ranking_weight=0.0)
    assert objectives.ranking_head is None
    weighted, inputs, _ = padded_losses("sampled")
    retrieval, ranking = weighted.losses(*inputs)
    weighted.ranking_weight = 1.0
    assert torch.allclose(weighted.losses(*inputs)[1] * 0.5, ranking)  # the weight multiplies the loss


def test_the_retrieval_loss_choice():
    from lightning_hstu.models.hstu import FULL_SOFTMAX_MAX_ITEMS, resolve_retrieval

    assert resolve_retrieval("auto", 1682) == "full"
    assert resolve_retrieval("auto", FULL_SOFTMAX_MAX_ITEMS + 1) == "sampled"
    assert resolve_retrieval("in_batch", 10) == "in_batch"
    with pytest.raises(ValueError, match="unknown retrieval_loss 'bpr'; valid: auto, full, sampled, in_batch"):
        resolve_retrieval("bpr", 10)


def test_token_capacities_are_few_and_waste_at_most_a_thirty_second():
    from lightning_hstu.hstu.graphs import token_capacity

    capacities = [token_capacity(n, 10_000) for n in range(1, 10_001)]
    assert all(n <= c <= max(n * 1.03125, n + 1) for n, c in enumerate(capacities, 1))
    assert len(set(capacities[2048:4096])) == 32  # thirty-two per power of two
    assert token_capacity(9_999, 5_000) == 5_000


def test_training_flops_count_the_matrix_products_of_the_jagged_step():
    """The model FLOPs that MFU is taken against, by hand for one layer: 3 x (linear maps per token,
    q.k and a.v per causal pair and head, the retrieval scores and the ranking head per event)."""
    from lightning_hstu.models.hstu import HSTUObjectives

    config = HSTUConfig(embedding_dim=16, num_layers=1, num_heads=2, attention_dim=8, hidden_dim=4, max_seq_len=32)
    objectives = HSTUObjectives(config, num_actions=5, temperature=0.05)
    lengths, negatives = [3, 1], 4
    tokens, pairs = 4 + 2, (4 * 5 + 2 * 3) // 2
    layer = 2 * tokens * 16 * (2 * 16 + 2 * 8) + 2 * tokens * 8 * 16 + 2 * pairs * (16 + 8)
    events = 4 * (2 * 16 * (1 + negatives) + 2 * (32 * 16 + 16 * 5))
    assert objectives.training_flops(lengths, negatives) == 3 * (layer + events)


@pytest.mark.parametrize(
    "retrieval, item_neg_rows, expected",
    [("sampled", 4 * 16, 16), ("full", 1683, 1681), ("in_batch", 0, 300)],
)
def test_negatives_per_event_for_the_flops(retrieval, item_neg_rows, expected):
    """What MFU counts per event besides its target, from a batch of 4 histories with 300 events: a sample's
    own 16 sampled rows (64 in the batch), every other item of a 1,682-item catalogue (rows 0 .. 1682, id 0
    no item), or every event of the batch."""
    from lightning_hstu.models.hstu import HSTUObjectives

    config = HSTUConfig(embedding_dim=16, num_layers=1, num_heads=2, attention_dim=8, hidden_dim=4, max_seq_len=32)
    objectives = HSTUObjectives(config, num_actions=5, temperature=0.05, retrieval=retrieval)
    assert objectives.negatives_per_event(4, 300, item_neg_rows) == expected


@pytest.mark.parametrize("retrieval", ["sampled", "in_batch"])
def test_the_compiled_jagged_losses_equal_the_eager_ones(monkeypatch, retrieval):
    """``compile_layers`` on CUDA runs the losses after the stack through ``torch.compile``
    (``_compiled_jagged_sums``); the compiled function gives the eager one's losses and gradients (here on
    the CPU, put in the eager one's place), with rows past the real events."""
    from lightning_hstu.models import hstu

    expected = losses_and_gradients(*jagged_losses(retrieval, extra_rows=9, attention="grouped"))
    monkeypatch.setattr(hstu.HSTUObjectives, "_jagged_sums", hstu._compiled_jagged_sums())
    got = losses_and_gradients(*jagged_losses(retrieval, extra_rows=9, attention="grouped"))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
