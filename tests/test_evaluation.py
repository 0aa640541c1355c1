"""The ranking metrics every model and the most-popular baseline are measured by."""

import math
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_runs import QUIET
from ranks import run_on_ranks, run_script

from lightning_hstu.data.evaluation import (
    METRICS,
    NO_TARGET,
    RANKINGS,
    mean_metrics,
    metric_values,
    most_popular_ranks,
    target_ranks,
)
from lightning_hstu.data.histories import Collate, History, SyntheticHistories
from lightning_hstu.models.ranking import RankingEvaluation

SCRIPTS = Path(__file__).parent / "scripts"


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


def test_the_most_popular_baseline_of_an_unknown_stage_names_the_valid_ones():
    data = SyntheticHistories(num_users=8, num_items=30, max_seq_len=20, batch_size=2)
    data.setup()
    with pytest.raises(ValueError, match="unknown stage 'validation'; valid: val, test"):  # was KeyError: 'validation'
        data.most_popular("validation")


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


class _Scored(RankingEvaluation, pl.LightningModule):
    """RankingEvaluation with fixed scores per user, recording the names it logs."""

    def __init__(self, scores_by_user: dict[int, list[float]]):
        super().__init__()
        self.scores_by_user, self.logged = scores_by_user, set()

    def score_items(self, batch):
        users = batch.features["user"].values().tolist()
        return torch.tensor([self.scores_by_user[u] for u in users])

    def log(self, name, value, **kwargs):
        self.logged.add(name)

    def means(self, *batches) -> dict[str, float]:
        for pairs in batches:
            self._log_ranks("val", Collate(num_items=4, negatives=0, seed=0, with_targets=True)(pairs))
        return {key: float(mean.compute()) for key, mean in self.ranking_means.items() if key.startswith("val")}


def test_filler_samples_count_in_no_metric():
    """On several ranks the shorter shares of the evaluation pairs are filled up with a filler (target
    NO_TARGET): the stage's means are those of the real samples alone, whatever batches the fillers are in."""
    one, two = History(1, (2, 3), (0, 0), (1, 2)), History(2, (4,), (0,), (1,))
    scores = {1: [0.0, 0.1, 0.9, 0.2, 0.3], 2: [0.0, 0.9, 0.1, 0.2, 0.3]}  # user 1's target ranks 4th, 2's 1st
    model = _Scored(scores)
    expected = model.means([(one, 1), (two, 1)])
    assert expected["val_all_HR_at_1"] == 0.5 and expected["val_all_MRR"] == pytest.approx((1 / 4 + 1) / 2)
    assert model.logged == {f"val/{r}/{m}" for r in RANKINGS for m in METRICS}
    assert _Scored(scores).means([(one, 1), (two, 1), (one, NO_TARGET)]) == expected
    assert _Scored(scores).means([(one, 1)], [(two, NO_TARGET)], [(two, 1), (one, NO_TARGET)]) == expected


def _evaluation_shares(rank, world):
    data = SyntheticHistories(num_users=11, num_items=30, max_seq_len=20, batch_size=2, seed=3)
    data.setup()
    loader = data.val_dataloader()
    seen = []
    for batch in loader:
        users = batch.features["user"].values().tolist()
        seen.append(list(zip(users, batch.features["target"].values().tolist())))
    expected = sorted((h.user, target) for h, target in data.validation)
    return {"seen": seen, "distributed": isinstance(loader.sampler, DistributedSampler), "expected": expected}


def test_on_several_ranks_every_validation_user_is_evaluated_once(tmp_path):
    """Each rank evaluates its share of the pairs, as many batches as the others (the sharded tables'
    lookups are collectives); the shares together hold every pair once, the fillers aside (Lightning's
    DistributedSampler would repeat up to world - 1 real users instead), and Lightning leaves the sampler
    in place (a DistributedSampler)."""
    world = 3  # (two ranks: the Trainer test below)
    ranks = run_on_ranks(_evaluation_shares, tmp_path, world=world)
    assert all(r["distributed"] for r in ranks)
    assert len({len(r["seen"]) for r in ranks}) == 1  # the same number of batches on every rank
    samples = [pair for r in ranks for batch in r["seen"] for pair in batch]
    counted = sorted(pair for pair in samples if pair[1] != NO_TARGET)
    assert counted == ranks[0]["expected"]  # each pair once
    assert len(ranks[0]["expected"]) % world != 0  # (so that some rank has a filler)
    assert len(samples) - len(counted) == world - len(ranks[0]["expected"]) % world


def test_validation_on_two_ranks_gives_the_metrics_of_every_user_once(tmp_path):
    """Trainer.validate under Lightning's DDP on two processes: the logged metrics are the means over the
    validation users, each counted once."""
    sys.path.insert(0, str(SCRIPTS))
    from validate_two_ranks import DATA, fixed_scores

    out = tmp_path / "metrics.pt"
    result = run_script(SCRIPTS / "validate_two_ranks.py", tmp_path, out, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = torch.load(out)
    data = SyntheticHistories(**DATA)
    data.setup()
    histories = [h for h, _ in data.validation]
    history = torch.tensor([i for h in histories for i in h.items + h.earlier])
    lengths = torch.tensor([len(h.items) + len(h.earlier) for h in histories])
    users = torch.tensor([h.user for h in histories])
    targets = torch.tensor([t for _, t in data.validation])
    expected = mean_metrics(target_ranks(fixed_scores(users, data.num_items), targets, history, lengths))
    assert len(histories) % 2 == 1  # one rank's share is filled up
    for ranking, metrics in expected.items():
        for name, value in metrics.items():
            assert logged[f"val/{ranking}/{name}"] == pytest.approx(value, rel=1e-6), (ranking, name)


@pytest.mark.parametrize("model_name", ["HSTU", "SASRec"])
def test_scores_stay_fp32_under_bf16_autocast(model_name):
    """Under ``precision="bf16-mixed"`` (recommended for HSTU on GPUs) the scores came out in bf16, steps of
    2^-8 near a cosine of 1: about 0.6 other items per user tied with the held-out item on 1,000 items, each
    counted above it, so the same weights validated lower than in fp32 (NDCG@10 0.2921 against 0.2955)."""
    from small_hstu import SMALL_MODEL, small_data

    from lightning_hstu import HSTUPipelineStrategy
    from lightning_hstu.models.hstu import HSTURecommender
    from lightning_hstu.models.sasrec import SASRecRecommender

    pl.seed_everything(0, verbose=False)
    data = small_data(num_users=64, num_items=1000)
    if model_name == "HSTU":
        model = HSTURecommender(**SMALL_MODEL)
    else:
        model = SASRecRecommender(embedding_dim=16, num_layers=1, max_seq_len=32, num_items=1000)
    trainer = pl.Trainer(
        strategy=HSTUPipelineStrategy("legacy_none"), accelerator="cpu", devices=1, max_steps=2, **QUIET
    )
    trainer.fit(model, data)
    model.eval()
    batch = next(iter(data.val_dataloader()))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        scores = model.score_items(batch)
    assert scores.dtype == torch.float32
    targets = batch.features["target"].values()
    tied = (scores == scores.gather(1, targets[:, None])).sum(1) - 1
    assert tied.sum() == 0


def test_the_unseen_ranking_leaves_out_the_items_before_a_cut_history():
    """A user who rated items 1-10, the model reading the last 4: items 1-6 are seen too (before, "unseen"
    counted them: the held-out item ranked 7th among items "not in the user's history", all of them rated)."""
    from lightning_hstu.models.ranking import seen_items

    whole = History(1, tuple(range(1, 11)), (0,) * 10, tuple(range(10)))
    cut = whole.last(4)
    assert cut.items == (7, 8, 9, 10) and cut.earlier == (1, 2, 3, 4, 5, 6)
    other = History(2, (3, 4), (0, 0), (0, 1))  # a second sample, not cut
    batch = Collate(12, 0, 0, with_targets=True, earlier=True)([(cut, 11), (other, 11)])
    items, lengths = seen_items(batch)
    assert lengths.tolist() == [10, 2]
    assert sorted(items[:10].tolist()) == list(range(1, 11)) and sorted(items[10:].tolist()) == [3, 4]
    scores = torch.zeros(2, 13)
    scores[:, 1:11] = 1.0  # every rated item above the held-out 11
    scores[:, 11] = 0.5
    ranks = target_ranks(scores, torch.tensor([11, 11]), items, lengths)
    assert ranks["all"].tolist() == [10, 10]
    assert ranks["unseen"].tolist() == [0, 8]  # the second user rated only 3 and 4
