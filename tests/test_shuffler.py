"""The balanced shuffler on two gloo ranks: every sample exactly once across ranks, histories intact,
equal batch sizes, and a lower max/mean cost on zipf data. And the jagged select/concat it rests on."""

import random

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ranks import run_on_ranks

from lightning_hstu.hstu.batch import HSTUBatch
from lightning_hstu.hstu.shuffler import BalancedShuffler


def make_batch(users, max_len=64, seed=0):
    """Histories with zipf(1.2) lengths; item ids encode (user, position) so any mix-up shows."""
    rng = random.Random(seed)
    weights = [1 / k**1.2 for k in range(1, max_len + 1)]
    lengths = rng.choices(range(1, max_len + 1), weights=weights, k=len(users))
    items = [u * 1000 + p for u, n in zip(users, lengths) for p in range(n)]
    actions = [(u + p) % 5 for u, n in zip(users, lengths) for p in range(n)]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["item", "action", "user"],
        values=torch.tensor(items + actions + list(users)),
        lengths=torch.tensor(lengths + lengths + [1] * len(users)),
    )
    return HSTUBatch(kjt)


def histories(batch):
    """user -> (items, actions) of every sample in the batch."""
    f = batch.features
    items = f["item"].values().split(f["item"].lengths().tolist())
    actions = f["action"].values().split(f["action"].lengths().tolist())
    return {int(u): (i.tolist(), a.tolist()) for u, i, a in zip(f["user"].values(), items, actions)}


def test_select_and_concat_keep_each_history_whole():
    a, b = make_batch(range(0, 5), seed=1), make_batch(range(5, 9), seed=2)
    both = HSTUBatch.concat([a, b])
    assert histories(both) == {**histories(a), **histories(b)}
    picked = both.select(torch.tensor([7, 0, 3]))
    assert [int(u) for u in picked.features["user"].values()] == [7, 0, 3]
    assert histories(picked) == {u: histories(both)[u] for u in (7, 0, 3)}


def test_a_batch_gives_its_keys_values_and_history_lengths_as_the_features_hold_them():
    """``values_of`` (one split where the per-key counts are known) and ``sequence_lengths`` (a view of the
    lengths) give what TorchRec's per-key lookup gives: for a batch that knows its counts, one that does
    not, and one the shuffler's select made."""
    known = make_batch(range(0, 6), seed=3)
    f = known.features
    unknown = HSTUBatch(KeyedJaggedTensor(keys=f.keys(), values=f.values(), lengths=f.lengths()))
    assert unknown.features.length_per_key_or_none() is None
    for batch in (known, unknown, known.select(torch.tensor([4, 1, 5]))):
        features = batch.features
        values = batch.values_of("user", "item", "action")
        for key, got in zip(("user", "item", "action"), values):
            assert torch.equal(got, features[key].values()), key
        assert torch.equal(batch.sequence_lengths(), features["item"].lengths())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_samples_are_picked_without_waiting_for_it():
    """A batch that came from the host is cut on the GPU from a plan made on the host: no device sync."""
    batch = make_batch(range(12), seed=3)
    on_gpu = batch.to(torch.device("cuda"))
    samples = torch.tensor([11, 0, 5, 5])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        picked = on_gpu.select(samples)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert histories(picked.to(torch.device("cpu"))) == histories(batch.select(samples))
    assert picked.features.lengths().tolist() == batch.select(samples).features.lengths().tolist()


def _shuffle_once(rank, world):
    batch = make_batch(range(rank * 16, (rank + 1) * 16), seed=rank)
    shuffler = BalancedShuffler(local_batch_size=16)
    shuffled = shuffler.finish(shuffler.start(batch))
    assert torch.equal(shuffled.host_lengths, shuffled.features.lengths())  # what the next shuffle plans from
    return {
        "size": shuffled.size,
        "histories": histories(shuffled),
        "before": histories(batch),
        "balance": (shuffler.last_balance.before, shuffler.last_balance.after),
    }


def test_two_ranks_get_every_sample_exactly_once_with_a_better_balance(tmp_path):
    ranks = run_on_ranks(_shuffle_once, tmp_path)
    assert [r["size"] for r in ranks] == [16, 16]
    original = {**ranks[0]["before"], **ranks[1]["before"]}
    after = [r["histories"] for r in ranks]
    assert sorted(list(after[0]) + list(after[1])) == sorted(original)  # each user once, on one rank
    assert {**after[0], **after[1]} == original  # every history intact
    before, balanced = ranks[0]["balance"]
    assert ranks[1]["balance"] == (before, balanced)  # both ranks computed the same partition
    assert balanced < before


def test_one_rank_is_the_identity():
    batch = make_batch(range(8))
    shuffler = BalancedShuffler(local_batch_size=8)
    assert shuffler.finish(shuffler.start(batch)) is batch
    assert (shuffler.last_balance.before, shuffler.last_balance.after) == (1.0, 1.0)


def _short_batch(rank, world):
    shuffler = BalancedShuffler(local_batch_size=16)
    try:
        shuffler.start(make_batch(range(rank * 16, rank * 16 + 15)))  # one sample short
    except ValueError as error:
        return str(error)
    return None


def test_a_batch_of_the_wrong_size_is_named_before_any_collective(tmp_path):
    for message in run_on_ranks(_short_batch, tmp_path):
        assert message == (
            "balanced shuffling needs batches of local_batch_size=16 samples on every rank, "
            "got 15 (use drop_last=True, or disable it)"
        )
