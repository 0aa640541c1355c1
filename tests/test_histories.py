"""The training batches' sampled negatives: each batch its own draw, whichever loader worker collates it, in
every epoch, and the same draw again after a resume."""

import pickle

from small_hstu import small_data

from lightning_hstu.data.histories import Collate, History


def history(user: int) -> History:
    return History(user, (1, 2, 3), (0, 0, 0), (10, 20, 30))


def negatives(collate: Collate, users: list[int]) -> list[int]:
    return collate([history(u) for u in users]).features["item_neg"].values().tolist()


def test_each_batch_draws_its_own_negatives_whoever_collates_it():
    collate = Collate(num_items=1000, negatives=8, seed=3)
    worker = pickle.loads(pickle.dumps(collate))  # what a DataLoader worker holds
    first, second = negatives(collate, [1, 2, 3, 4]), negatives(collate, [5, 6, 7, 8])
    assert first != second
    assert negatives(worker, [5, 6, 7, 8]) == second  # in another process, in another order of batches
    assert negatives(worker, [1, 2, 3, 4]) == first
    assert negatives(Collate(num_items=1000, negatives=8, seed=4), [1, 2, 3, 4]) != first  # the seed counts
    assert all(1 <= i <= 1000 for i in first)


def test_a_loader_with_two_workers_draws_new_negatives_for_every_batch_and_epoch():
    data = small_data(num_workers=2)
    data.setup("fit")
    loader = data.train_dataloader()
    draws = [tuple(b.features["item_neg"].values().tolist()) for _ in range(2) for b in loader]  # two epochs
    assert len(draws) > 4 and len(set(draws)) == len(draws)
