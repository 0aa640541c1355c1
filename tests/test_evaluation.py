"""The ranking metrics every model and the most-popular baseline are measured by."""

import math

import pytest
import torch

from lightning_hstu.data.evaluation import METRICS, mean_metrics, metric_values, most_popular_ranks, target_ranks
from lightning_hstu.data.histories import History


def test_the_held_out_item_is_ranked_among_all_items_and_among_the_unseen_ones():
    #                      item: 0     1    2    3    4    5
    scores = torch.tensor([[9.0, 0.9, 0.8, 0.7, 0.6, 0.5], [9.0, 0.1, 0.2, 0.3, 0.4, 0.5]])
    targets = torch.tensor([3, 1])
    history = torch.tensor([1, 4, 1, 5, 2])  # user 0 saw 1 and 4; user 1 saw 1 (its target again), 5 and 2
    ranks = target_ranks(scores, targets, history, torch.tensor([2, 3]))
    assert ranks["all"].tolist() == [2, 4]  # item 0 is no item: never ranked
    assert ranks["unseen"].tolist() == [1, 2]  # user 0: 4 left out; user 1: 5 and 2 left out, its target stays in


def test_metrics_from_ranks():
    values = metric_values(torch.tensor([0, 9, 10, 49, 50]))
    assert values["HR@1"].tolist() == [1, 0, 0, 0, 0]
    assert values["HR@10"].tolist() == [1, 1, 0, 0, 0]
    assert values["HR@50"].tolist() == [1, 1, 1, 1, 0]
    assert values["NDCG@10"].tolist() == pytest.approx([1, 1 / math.log2(11), 0, 0, 0])
    assert values["NDCG@50"].tolist() == pytest.approx([1, 1 / math.log2(11), 1 / math.log2(12), 1 / math.log2(51), 0])
    assert values["MRR"].tolist() == pytest.approx([1, 1 / 10, 1 / 11, 1 / 50, 1 / 51])
    assert set(values) == set(METRICS)


def test_the_most_popular_baseline_ranks_by_training_counts():
    train = [(1, 2, 2), (2, 3), (2,)]  # counts: 2 -> 4, 1 -> 1, 3 -> 1 (tie: smaller id first)
    evaluation = [(History(1, (2,), (0,), (0,)), 1), (History(2, (1, 3), (0, 0), (0, 0)), 3)]
    ranks = most_popular_ranks(train, evaluation, num_items=4)
    assert ranks["all"].tolist() == [1, 2]
    assert ranks["unseen"].tolist() == [0, 1]  # user 1's 2 and user 2's 1, seen, are left out
    means = mean_metrics(ranks)
    assert means["unseen"]["HR@1"] == 0.5 and means["all"]["MRR"] == pytest.approx((1 / 2 + 1 / 3) / 2)


def test_ties_and_nan_scores_rank_above_the_held_out_item():
    """A model that scores every item alike, or diverged to NaN, gets the worst ranks, not the best."""
    history, lengths = torch.tensor([1, 1]), torch.tensor([1, 1, 0, 0])
    alike = torch.zeros(4, 6)
    nan = torch.full((4, 6), float("nan"))
    some_nan = torch.tensor([[0.0, 0.9, 0.8, 0.7, float("nan"), 0.5]]).expand(4, -1)
    nan_target = torch.tensor([[0.0, 0.9, 0.8, float("nan"), 0.6, 0.5]]).expand(4, -1)
    targets = torch.tensor([3, 3, 3, 3])
    assert target_ranks(alike, targets, history, lengths)["all"].tolist() == [4, 4, 4, 4]  # items 1-5 but 3
    assert target_ranks(alike, targets, history, lengths)["unseen"].tolist() == [3, 3, 4, 4]  # 1 seen by two
    assert target_ranks(nan, targets, history, lengths)["all"].tolist() == [4, 4, 4, 4]
    assert target_ranks(some_nan, targets, history, lengths)["all"].tolist() == [3, 3, 3, 3]  # 1, 2 and NaN 4
    assert target_ranks(nan_target, targets, history, lengths)["all"].tolist() == [4, 4, 4, 4]
    assert mean_metrics(target_ranks(nan, targets, history, lengths))["all"]["HR@1"] == 0.0


def test_the_most_popular_baseline_breaks_ties_by_id_at_any_count():
    train = [(5,) * 3000 + (2,) * 3000 + (1,) * 2999]  # 2 and 5 tie at 3000: 2 first, then 5, then 1
    evaluation = [(History(1, (), (), ()), 5), (History(2, (), (), ()), 2), (History(3, (), (), ()), 1)]
    assert most_popular_ranks(train, evaluation, num_items=6)["all"].tolist() == [1, 0, 2]
