"""The equal-size Karmarkar-Karp partition behind the balanced shuffler."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_hstu.hstu.balance import hstu_cost, imbalance, karmarkar_karp


def zipf_lengths(n, max_len, seed, alpha=1.2):
    rng = random.Random(seed)
    weights = [1 / k**alpha for k in range(1, max_len + 1)]
    return rng.choices(range(1, max_len + 1), weights=weights, k=n)


@settings(max_examples=200, deadline=None)
@given(parts=st.integers(1, 8), per_part=st.integers(0, 12), data=st.data())
def test_every_sample_lands_in_exactly_one_set_of_equal_size(parts, per_part, data):
    costs = data.draw(st.lists(st.integers(0, 10_000), min_size=parts * per_part, max_size=parts * per_part))
    sets = karmarkar_karp(costs, parts)
    assert len(sets) == parts
    assert all(len(s) == per_part for s in sets)
    assert sorted(i for s in sets for i in s) == list(range(len(costs)))
    assert karmarkar_karp(costs, parts) == sets  # every rank computes the same partition


def snake(costs, parts):
    """The simple equal-size heuristic: deal the samples, heaviest first, back and forth across sets."""
    order = sorted(range(len(costs)), key=lambda i: -costs[i])
    sets = [[] for _ in range(parts)]
    for position, index in enumerate(order):
        turn = position % (2 * parts)
        sets[turn if turn < parts else 2 * parts - 1 - turn].append(index)
    return sets


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_it_lowers_the_rank_imbalance_of_zipf_batches(ranks):
    local_batch = 32  # the seed's benchmark: local batch 32, zipf(1.2) lengths up to 512 here
    for seed in range(10):
        costs = [hstu_cost(n) for n in zipf_lengths(ranks * local_batch, 512, seed)]
        as_loaded = [list(range(r * local_batch, (r + 1) * local_batch)) for r in range(ranks)]
        balanced = karmarkar_karp(costs, ranks)
        assert imbalance(costs, balanced) < imbalance(costs, as_loaded)
        assert imbalance(costs, balanced) <= imbalance(costs, snake(costs, ranks))


def test_a_sample_heavier_than_a_fair_share_is_alone_with_the_lightest():
    sets = karmarkar_karp([100, 1, 1, 1, 1, 1], 2)
    heavy = next(s for s in sets if 0 in s)
    assert len(heavy) == 3 and sum([100, 1, 1, 1, 1, 1][i] for i in heavy) == 102


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match="5 samples cannot be split into 2 sets of equal size"):
        karmarkar_karp([1] * 5, 2)
    with pytest.raises(ValueError, match="parts must be at least 1"):
        karmarkar_karp([1], 0)
