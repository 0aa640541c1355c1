"""Reading MovieLens files into histories (offline: small files in the GroupLens formats)."""

import re

import pytest

from lightning_hstu.data.histories import leave_two_out
from lightning_hstu.data.movielens import DataFileError, MovieLens, histories_from, read_ratings


def test_ml100k_rows_become_time_ordered_histories_with_renumbered_ids(tmp_path):
    (tmp_path / "u.data").write_text("7\t50\t5\t300\n7\t10\t3\t100\n2\t10\t4\t200\n7\t99\t1\t200\n")
    histories = histories_from(read_ratings("ml-100k", str(tmp_path)))
    assert [(h.user, h.items, h.actions, h.times) for h in histories] == [
        (1, (1,), (3,), (200,)),  # user 2; items 10, 50, 99 -> 1, 2, 3; rating r -> action r - 1
        (2, (1, 3, 2), (2, 0, 4), (100, 200, 300)),
    ]


def test_ml20m_half_stars_are_ten_action_classes(tmp_path):
    (tmp_path / "ratings.csv").write_text("userId,movieId,rating,timestamp\n1,5,0.5,10\n1,6,5.0,20\n1,7,3.5,30\n")
    (history,) = histories_from(read_ratings("ml-20m", str(tmp_path)), half_stars=True)
    assert history.actions == (0, 9, 6)


def test_ml20m_ratings_keep_their_action_class_in_a_file_without_half_stars(tmp_path):
    """The classes come from the dataset's scale, not from what a file happens to hold: 4.0 is class 7 in every
    ML-20M file (it was class 3 in a part of the file with no half star)."""
    (tmp_path / "ratings.csv").write_text("userId,movieId,rating,timestamp\n1,5,4.0,10\n1,6,1.0,20\n")
    movielens = MovieLens("ml-20m", root=str(tmp_path))
    (history,) = movielens.load()
    assert history.actions == (7, 1)


@pytest.mark.parametrize(
    "dataset, line, named",
    [
        ("ml-100k", "1\t5\t0\t10", "rating '0' is not one of this dataset's (1, 2, 3, 4, 5)"),
        ("ml-100k", "1\t5\tnan\t10", "rating 'nan' is not one of"),
        ("ml-100k", "1\t5\t3\tinf", "expected user, item, rating and timestamp"),
        ("ml-100k", "1\t5\t3\t10\t7", "expected user, item, rating and timestamp"),
        ("ml-20m", "1,5,0.25,10", "rating '0.25' is not one of this dataset's (0.5, 1, 1.5,"),
    ],
    ids=["rating 0", "nan rating", "infinite time", "a fifth column", "quarter star"],
)
def test_a_rating_off_the_scale_or_an_extra_column_is_refused_naming_the_line(tmp_path, dataset, line, named):
    good = "1\t6\t4\t5" if dataset == "ml-100k" else "1,6,4.0,5"
    header = "userId,movieId,rating,timestamp\n" if dataset == "ml-20m" else ""
    file = "ratings.csv" if dataset == "ml-20m" else "u.data"
    (tmp_path / file).write_text(f"{header}{good}\n{line}\n")
    number = 3 if header else 2
    with pytest.raises(DataFileError, match=f"line {number}: " + re.escape(named)):
        read_ratings(dataset, str(tmp_path))


def test_ml1m_format(tmp_path):
    (tmp_path / "ratings.dat").write_text("1::1193::5::978300760\n1::661::3::978302109\n")
    (history,) = histories_from(read_ratings("ml-1m", str(tmp_path)))
    assert history.items == (2, 1) and history.actions == (4, 2)


def test_unknown_dataset_and_missing_folder_are_named(tmp_path):
    with pytest.raises(ValueError, match="unknown MovieLens dataset 'ml-2m'; valid: ml-100k, ml-1m, ml-20m"):
        MovieLens("ml-2m")
    with pytest.raises(ValueError, match="ml-1m is read from a local GroupLens folder"):
        MovieLens("ml-1m")
    with pytest.raises(FileNotFoundError, match="no ratings.dat in"):
        read_ratings("ml-1m", str(tmp_path))


def test_leave_two_out_validates_on_the_second_to_last_item_and_tests_on_the_last(tmp_path):
    (tmp_path / "u.data").write_text(
        "".join(
            f"{u}\t{i}\t4\t{t}\n"
            for u, i, t in [
                (1, 1, 1),
                (1, 2, 2),
                (1, 3, 3),
                (1, 4, 4),
                (2, 1, 1),
                (2, 2, 2),
                (2, 1, 3),
                (2, 3, 4),
                (3, 5, 1),
                (3, 1, 2),
                (3, 2, 3),
            ]
        )
    )
    histories = histories_from(read_ratings("ml-100k", str(tmp_path)))
    split = leave_two_out(histories, max_len=10)
    assert [h.items for h in split.train] == [(1, 2), (1, 2)]  # user 3 has too short a history
    assert [(h.items, target) for h, target in split.validation] == [((1, 2), 3), ((1, 2), 1)]
    assert [(h.items, target) for h, target in split.test] == [((1, 2, 3), 4), ((1, 2, 1), 3)]
    long = leave_two_out(histories, max_len=1)
    assert [h.items for h, _ in long.test] == [(3,), (1,)]  # the most recent events are kept


def test_length_buckets_give_every_sample_once_in_batches_of_like_lengths():
    import random

    import torch

    from lightning_hstu.data.histories import LengthBuckets

    lengths = [random.Random(i).randrange(2, 200) for i in range(100)]
    sampler = LengthBuckets(lengths, batch_size=10, pool_batches=5, seed=0)
    first, second = list(sampler), list(sampler)
    assert sorted(first) == list(range(100)) and sorted(second) == list(range(100))
    assert first != second  # a new order every epoch
    batches = [first[i : i + 10] for i in range(0, 100, 10)]
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)
    assert spread < 60  # sorted pools of 50: about 40; a random batch of 10 spans about 160 of the 198 lengths
    # 95 samples: the permutation's last 5 are set aside and come last, so every run of 10 before them is one
    # sorted batch of one pool (in the middle, the remainder shifted every later run across two of them), and
    # what drop_last drops is random samples, not the longest of a pool
    order = list(LengthBuckets(lengths[:95], batch_size=10, pool_batches=5, seed=1))
    permutation = torch.randperm(95, generator=torch.Generator().manual_seed(1_000_003)).tolist()  # its first draw
    built = []
    for start in range(0, 90, 50):
        pool = sorted(permutation[start : min(start + 50, 90)], key=lengths.__getitem__)
        built += [set(pool[i : i + 10]) for i in range(0, len(pool), 10)]
    assert all(set(order[i : i + 10]) in built for i in range(0, 90, 10))
    assert order[90:] == permutation[90:]
    # each epoch's order from the seed and the epoch: the same after a resume, whatever came before
    again = LengthBuckets(lengths, batch_size=10, pool_batches=5, seed=0)
    again.set_epoch(1)
    assert list(again) == second


def test_the_strategy_trains_the_length_buckets_batches():
    """A fit under HSTUPipelineStrategy (a DDPStrategy, so Lightning gives its training loader a distributed
    sampler) trains the batches ``LengthBuckets`` made. Before, Lightning wrapped the bucketed order in its
    DistributedSamplerWrapper, which shuffled it: batches spanned as many lengths as a plain shuffle's."""
    import sys
    from pathlib import Path

    import lightning.pytorch as pl

    sys.path.insert(0, str(Path(__file__).parent))
    from lightning_runs import QUIET
    from small_hstu import SMALL_MODEL, small_data

    from lightning_hstu import HSTUPipelineStrategy
    from lightning_hstu.data.histories import LengthBuckets
    from lightning_hstu.models.hstu import HSTURecommender

    class Users(pl.Callback):
        def __init__(self):
            self.batches = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.batches.append(batch.features["user"].values().tolist())

    pl.seed_everything(0, verbose=False)
    users, data = Users(), small_data(length_buckets=4)
    trainer = pl.Trainer(
        strategy=HSTUPipelineStrategy("legacy_none"),
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_val_batches=0,
        callbacks=[users],
        **QUIET,
    )
    trainer.fit(HSTURecommender(**SMALL_MODEL), data)
    histories = data.train_histories
    order = list(LengthBuckets([len(h.items) for h in histories], data.batch_size, 4, data.seed))
    expected = [[histories[i].user for i in order[s : s + data.batch_size]] for s in range(0, len(order), 8)]
    assert users.batches == expected[: len(users.batches)] and len(users.batches) == len(histories) // 8


def test_length_buckets_on_two_ranks_give_each_rank_like_lengths_and_every_sample_at_most_once():
    """Each step's two batches are one sorted global batch of a pool, cut in two: each rank's batch is alike
    (the balanced shuffler then evens their costs), the ranks run as many batches, and no sample is trained
    twice in an epoch; the permutation's remainder that fills no global batch is split too, for drop_last."""
    import random

    from lightning_hstu.data.histories import LengthBuckets

    lengths = [random.Random(i).randrange(2, 200) for i in range(205)]
    shares = [list(LengthBuckets(lengths, 10, pool_batches=5, num_replicas=2, rank=r)) for r in (0, 1)]
    assert len(shares[0]) == len(shares[1]) == len(LengthBuckets(lengths, 10, 5, num_replicas=2)) == 102
    assert not set(shares[0]) & set(shares[1])
    for step in range(10):  # 200 of the 205 samples: 10 global batches of 20
        a, b = (set(share[step * 10 : (step + 1) * 10]) for share in shares)
        assert max(lengths[i] for i in a) <= min(lengths[i] for i in b)  # one sorted global batch, cut in two
    batches = [shares[0][s : s + 10] for s in range(0, 100, 10)] + [shares[1][s : s + 10] for s in range(0, 100, 10)]
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)
    assert spread < 60  # as alike as one rank's (sorted pools of 100 samples: about 20)


@pytest.mark.parametrize("events, usable", [(6, 5), (3, 0)], ids=["5 users to train on", "none"])
def test_too_few_users_for_one_training_batch_is_an_error_not_a_fit_that_trains_nothing(tmp_path, events, usable):
    """Training batches are whole (drop_last): 5 users under batch_size=8 made no batch, and a fit stopped at
    once ('No training batches', a log line), its test then measuring the untrained model."""
    ratings = "".join(
        f"{user}::{100 + k}::{1 + k % 5}::{1000 * user + k}\n" for user in range(1, 6) for k in range(events)
    )
    (tmp_path / "ratings.dat").write_text(ratings)
    data = MovieLens("ml-1m", root=str(tmp_path), batch_size=8)
    with pytest.warns(UserWarning, match="holds"):
        data.setup()
    with pytest.raises(ValueError, match=f"{usable} of the 5 users have the 4 events .* batch_size=8"):
        data.train_dataloader()
