"""User histories for HSTU: leave-two-out splits, batches as one KeyedJaggedTensor, sampled negatives, and
the most-popular baseline evaluated the same way as the model.

Batch keys: embedded by the model's EmbeddingCollection: ``item`` (the history), ``item_neg`` (sampled
negatives for the retrieval loss), ``action`` (one per event), ``user`` (contextual, one per sample);
not embedded: ``time`` (one per event, seconds) and, for evaluation, ``target`` (the held-out item).
"""

import hashlib
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..checks import at_least
from ..hstu.batch import HSTUBatch, IdError, check_ids
from ..hstu.step import LOOKUP_KEYS
from .evaluation import NO_TARGET, mean_metrics, most_popular_ranks

FILLER_USER = 0
"""The user of a filler history in ``predict_dataloader``'s shorter shares (user ids count from 1)."""


@dataclass(frozen=True)
class History:
    user: int
    items: tuple[int, ...]
    actions: tuple[int, ...]
    times: tuple[int, ...]
    earlier: tuple[int, ...] = ()
    """The items of the events ``last`` cut off before these (the user has rated them too)."""

    def last(self, n: int) -> "History":
        cut = self.items[: max(len(self.items) - n, 0)]
        return History(self.user, self.items[-n:], self.actions[-n:], self.times[-n:], self.earlier + cut)

    def without_last(self, n: int = 1) -> "History":
        return History(self.user, self.items[:-n], self.actions[:-n], self.times[:-n], self.earlier)


def check_histories(histories: Sequence[History]) -> None:
    """Refuse histories the tables and the evaluation would read wrongly, naming the user: ``TypeError`` for
    fields that are not tuples (``History.last`` and the evaluation add them to the ``earlier`` tuple);
    ``IdError`` for an item or user id below 1 (ids count from 1; 0 means none: a padding id, a missing target,
    a filler user) or an action below 0; ``ValueError`` for events without one item, one action and one time
    each."""
    for h in histories:
        for field in ("items", "actions", "times", "earlier"):
            if not isinstance(getattr(h, field), tuple):
                raise TypeError(
                    f"user {h.user}'s history has its {field} as a {type(getattr(h, field)).__name__}: History "
                    f"takes tuples (tuple(...) in load())"
                )
        if not len(h.items) == len(h.actions) == len(h.times):
            raise ValueError(
                f"user {h.user}'s history has {len(h.items)} items, {len(h.actions)} actions and {len(h.times)} "
                f"times: every event needs one of each"
            )
        if h.user < 1:
            raise IdError(f"a history has user id {h.user}: user ids count from 1 (0 means none)")
        if min(h.items, default=1) < 1:
            raise IdError(
                f"user {h.user}'s history has item id {min(h.items)}: item ids count from 1 (0 means none: a "
                f"padding id, a missing target)"
            )
        if min(h.actions, default=0) < 0:
            raise IdError(f"user {h.user}'s history has action {min(h.actions)}: actions count from 0")


@dataclass(frozen=True)
class Split:
    """Leave-two-out: ``train`` histories, and (history, held-out item) pairs to validate and to test on."""

    train: list[History]
    validation: list[tuple[History, int]]
    test: list[tuple[History, int]]


def leave_two_out(histories: Sequence[History], max_len: int) -> Split:
    """Train on each user's history without its last two events; validate on predicting the second-to-last
    item from the events before it, test on predicting the last item from every event before it (the
    validation item included). Users with fewer than 4 events are left out."""
    usable = [h for h in histories if len(h.items) >= 4]
    return Split(
        train=[h.without_last(2).last(max_len) for h in usable],
        validation=[(h.without_last(2).last(max_len), h.items[-2]) for h in usable],
        test=[(h.without_last(1).last(max_len), h.items[-1]) for h in usable],
    )


def _integers(values: list, what: str) -> torch.Tensor:
    """``values`` as int64. Floats are refused: ids and times in seconds are whole numbers, and one float among
    them would make the whole batch's values floats (float32 times of about 1.7e9 lose gaps of up to 128 s,
    ids above 2^24 become other ids)."""
    tensor = torch.tensor(values) if values else torch.zeros(0, dtype=torch.int64)
    if tensor.is_floating_point():
        raise ValueError(
            f"History {what} must be integers, got {tensor.dtype} values (such as {values[0]!r}): convert them "
            f"in load() (times to whole seconds)"
        )
    return tensor.to(torch.int64)


class Collate:
    """Samples -> HSTUBatch, with ``negatives`` uniform item ids per sample, drawn from a generator seeded by
    ``seed`` and the batch's users in order: each batch its own draw, the same whichever loader worker
    collates it, in whatever epoch, and after a resume (a generator carried from batch to batch gave every
    worker the same draws, the same again each epoch, and restarted at a resume).

    ``rows``: each feature's table size; a batch with an id outside it raises ``IdError`` here, in the
    loader, where checking costs no wait for a GPU. ``earlier``: add a last key ``earlier``, each history's
    items before its window (``History.earlier``: what ``predict`` must not recommend again)."""

    def __init__(
        self,
        num_items: int,
        negatives: int,
        seed: int,
        with_targets: bool = False,
        rows: Mapping[str, int] | None = None,
        earlier: bool = False,
    ):
        self.num_items, self.negatives, self.with_targets = num_items, negatives, with_targets
        self.earlier = earlier
        self.rows = dict(rows or {})
        self.seed = seed

    def __call__(self, samples: list) -> HSTUBatch:
        histories = [s[0] for s in samples] if self.with_targets else samples
        lengths = [len(h.items) for h in histories]
        count = len(histories) * self.negatives
        generator = self._generator(histories) if count else None
        negatives = torch.randint(1, self.num_items + 1, (count,), generator=generator)
        values = [
            _integers([i for h in histories for i in h.items], "item ids"),
            negatives,
            _integers([a for h in histories for a in h.actions], "actions"),
            _integers([h.user for h in histories], "user ids"),
            _integers([t for h in histories for t in h.times], "times (seconds)"),
        ]
        key_lengths = [lengths, [self.negatives] * len(histories), lengths, [1] * len(histories), lengths]
        keys = [*LOOKUP_KEYS, "time"]
        if self.with_targets:
            keys.append("target")
            values.append(_integers([s[1] for s in samples], "held-out item ids"))
            key_lengths.append([1] * len(samples))
        if self.earlier:
            keys.append("earlier")
            values.append(_integers([i for h in histories for i in h.earlier], "earlier item ids"))
            key_lengths.append([len(h.earlier) for h in histories])
        features = KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.cat(values), lengths=torch.tensor([n for ls in key_lengths for n in ls])
        )
        check_ids(features, self.rows, lambda sample: f"user {histories[sample].user}")
        return HSTUBatch(features, sequence_keys=("item", "action", "time"))

    def _generator(self, histories: list[History]) -> torch.Generator:
        users = torch.tensor([h.user for h in histories], dtype=torch.int64).numpy().tobytes()
        digest = hashlib.blake2b(users, digest_size=8, key=str(self.seed).encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


class LengthBuckets(DistributedSampler):
    """A shuffled order of the samples in which each run of ``batch_size`` holds histories of similar
    length: every epoch, a random permutation is cut into pools of ``pool_batches`` global batches (one
    batch of each of the ``num_replicas`` ranks), each pool is sorted by length and cut into global batches,
    the global batches of all pools are shuffled, and rank ``rank`` takes its batch of each: the ranks'
    batches of one step are alike too. The permutation's remainder (its last ``len % (batch_size x
    num_replicas)`` samples, drawn at random) is set aside before the pools and comes last, split between
    the ranks, where a loader's ``drop_last`` drops it: in the middle it shifted every later batch across
    two of these runs (20 of 29 batches on ML-100K's 943 users), and taken from the last pool it would be
    that pool's longest histories every epoch. Padded attention costs batch x longest^2 and the padded
    losses batch x longest, so batches of like lengths train several times faster with the padded layout
    (the grouped one, the CPU's default, pads each group of like lengths only); each batch still mixes
    users drawn at random within a pool.

    A ``DistributedSampler``, so that Lightning leaves it in place under a distributed strategy (the
    ``DistributedSamplerWrapper`` it puts around other samplers shuffles their order, the buckets with it).
    Each epoch's order is drawn from ``seed`` and the epoch alone: Lightning calls ``set_epoch`` on a
    loader's sampler at each epoch's start, so a resumed fit draws the orders the uninterrupted one did (a
    generator carried from epoch to epoch restarted at the resume). Where nothing calls ``set_epoch`` the
    epoch counts the orders drawn."""

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        pool_batches: int,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
    ):
        super().__init__(lengths, num_replicas=num_replicas, rank=rank, shuffle=False, seed=seed)
        self.lengths, self.batch_size = list(lengths), batch_size
        self.step = batch_size * num_replicas  # a global batch
        self.pool = self.step * pool_batches

    def __len__(self) -> int:
        return len(self.lengths) // self.num_replicas

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        self.epoch += 1  # the next order's, unless set_epoch says otherwise
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        keep = len(order) - len(order) % self.step
        order, rest = order[:keep], order[keep:]  # the remainder: random samples, not a pool's longest
        batches = []
        for start in range(0, len(order), self.pool):
            pool = sorted(order[start : start + self.pool], key=self.lengths.__getitem__)
            batches.extend(pool[i : i + self.step] for i in range(0, len(pool), self.step))
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        for b in torch.randperm(len(batches), generator=generator).tolist():
            yield from batches[b][mine]
        yield from rest[self.rank :: self.num_replicas][: len(rest) // self.num_replicas]


class _ListDataset(Dataset):
    def __init__(self, items: list):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.items[index]


class EvaluationShares(DistributedSampler):
    """One rank's share of the evaluation pairs, in order (rank r takes pairs r, r + world, ...), the shorter
    shares filled up to the longest with the dataset's last entry, a filler (a pair whose target is
    ``NO_TARGET``; for ``predict``, a history of ``FILLER_USER``), so that
    every rank runs as many batches (the sharded tables' lookups are collectives). Lightning's own
    ``DistributedSampler`` fills up with real pairs instead, which up to world - 1 users then count twice in
    the metrics; being a ``DistributedSampler``, this one is left in place by Lightning."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
        self.pairs = len(dataset) - 1  # the last entry is the filler
        self.num_samples = math.ceil(self.pairs / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def __iter__(self):
        share = list(range(self.rank, self.pairs, self.num_replicas))
        return iter(share + [self.pairs] * (self.num_samples - len(share)))

    def __len__(self) -> int:
        return self.num_samples


def _world_and_rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class HistoryDataModule(pl.LightningDataModule):
    """Leave-two-out training, validation and test over a set of user histories (subclasses load them).

    ``negatives``: uniform item ids drawn per training sample for ``retrieval_loss='sampled'`` (0 for the
    other losses, which do not read them). ``length_buckets``: batches of similar history lengths
    (``LengthBuckets`` with that many global batches per pool, each rank taking its share; 0, a plain
    shuffle)."""

    def __init__(
        self,
        batch_size: int = 32,
        max_seq_len: int = 200,
        negatives: int = 64,
        seed: int = 0,
        num_workers: int = 0,
        length_buckets: int = 0,
    ):
        super().__init__()
        at_least(1, batch_size=batch_size, max_seq_len=max_seq_len)
        at_least(0, negatives=negatives, num_workers=num_workers)
        if length_buckets < 0:
            raise ValueError(
                f"length_buckets must be 0 (plain shuffle) or a number of batches per pool, got {length_buckets}"
            )
        self.length_buckets = length_buckets
        self.batch_size, self.max_seq_len, self.negatives = batch_size, max_seq_len, negatives
        self.seed, self.num_workers = seed, num_workers
        self.num_items = self.num_users = self.num_events = 0
        self.num_actions = 5
        self.train_histories: list[History] = []
        self.validation: list[tuple[History, int]] = []
        self.test: list[tuple[History, int]] = []
        self.latest: list[History] = []
        """Every user's whole history (its last ``max_seq_len`` events, the items before them in ``earlier``):
        what ``predict`` recommends after."""
        self.user_ids: Sequence[int] | None = None
        """The dataset's own id of each user id the model uses (index: the model's id), where ``load`` renumbered
        them (``MovieLens``); None: the ids are the dataset's."""
        self.item_ids: Sequence[int] | None = None
        """The same for items."""

    def load(self) -> list[History]:
        raise NotImplementedError

    def table_rows(self) -> dict[str, int]:
        """Each feature's embedding table size for this data: item and user ids count from 1 (0 means
        none), actions from 0; the held-out ``target`` is an item."""
        items = self.num_items + 1
        return {
            "item": items,
            "item_neg": items,
            "target": items,
            "earlier": items,
            "action": self.num_actions,
            "user": self.num_users + 1,
        }

    def setup(self, stage: str | None = None) -> None:
        if self.train_histories:
            return
        histories = self.load()
        check_histories(histories)
        if not any(h.items for h in histories):  # the tables are sized by the largest ids
            raise ValueError(f"{type(self).__name__}.load() returned {len(histories)} histories and no event")
        self.num_items = max(i for h in histories for i in h.items)
        self.num_users = max(h.user for h in histories)
        self.num_actions = max(a for h in histories for a in h.actions) + 1
        self.num_events = sum(len(h.items) for h in histories)
        split = leave_two_out(histories, self.max_seq_len)
        self.train_histories, self.validation, self.test = split.train, split.validation, split.test
        self.latest = [h.last(self.max_seq_len) for h in histories if h.items]

    @property
    def split(self) -> str:
        """Which users' held-out items the metrics are of: reports put side by side only runs of the same split
        (after ``setup``: the counts tell another file or another part of one apart). ``max_seq_len`` cuts
        the inputs only, so runs that read histories of other lengths share it."""
        return f"{type(self).__name__} ({self.counts}), leave-two-out"

    @property
    def description(self) -> str:
        """The split and how much of each history the model read."""
        return f"{self.split}, histories of at most {self.max_seq_len} events"

    @property
    def counts(self) -> str:
        return f"{self.num_users:,} users, {self.num_items:,} items, {self.num_events:,} events"

    def train_dataloader(self) -> DataLoader:
        # drop_last: the balanced shuffler exchanges fixed-size pieces between ranks
        self._check_one_batch()
        generator = torch.Generator().manual_seed(self.seed)
        order = dict(shuffle=True, generator=generator)
        if self.length_buckets:
            lengths = [len(h.items) for h in self.train_histories]
            world, rank = _world_and_rank()
            buckets = LengthBuckets(lengths, self.batch_size, self.length_buckets, self.seed, world, rank)
            order = dict(sampler=buckets)
        return DataLoader(
            _ListDataset(self.train_histories),
            batch_size=self.batch_size,
            **order,
            drop_last=True,
            collate_fn=Collate(self.num_items, self.negatives, self.seed, rows=self.table_rows()),
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
        )  # pinned: the h2d copy can be asynchronous

    def _check_one_batch(self) -> None:
        """Refuse training data that makes no whole batch: Lightning would stop the fit at once, with a log
        line, and what came after it (a test, a report) would measure the untrained model."""
        usable = len(self.train_histories)
        if usable >= self.batch_size:
            return
        fix = f"set batch_size to at most {usable}" if usable else "give users at least 4 events"
        raise ValueError(
            f"{usable} of the {len(self.latest)} users have the 4 events leave-two-out needs to train on one, "
            f"fewer than batch_size={self.batch_size}: training batches are whole (drop_last), so there would be "
            f"none; {fix}"
        )

    def val_dataloader(self) -> DataLoader:
        return self._evaluation_loader(self.validation)

    def test_dataloader(self) -> DataLoader:
        return self._evaluation_loader(self.test)

    def predict_dataloader(self) -> DataLoader:
        """Every user's whole history (``latest``: the validation and test items included), once, for
        ``trainer.predict`` to recommend the items after it (``RankingEvaluation.predict_step``). On several
        ranks each takes its share, the shorter shares filled up with a history of user 0 (no user), which
        ``predict_step`` leaves out."""
        return self._shared_loader(
            self.latest,
            length=lambda history: len(history.items),
            filler=lambda history: replace(history, user=FILLER_USER),
            collate=Collate(self.num_items, 0, self.seed + 2, rows=self.table_rows(), earlier=True),
        )

    def _evaluation_loader(self, pairs: list[tuple[History, int]]) -> DataLoader:
        """Every pair once. On several ranks each takes its share (``EvaluationShares``), the shorter shares
        filled up with a pair whose target is ``NO_TARGET``, which ``RankingEvaluation`` leaves out."""
        return self._shared_loader(
            pairs,
            length=lambda pair: len(pair[0].items),
            filler=lambda pair: (pair[0], NO_TARGET),
            collate=Collate(self.num_items, 0, self.seed + 1, with_targets=True, rows=self.table_rows(), earlier=True),
        )

    def _shared_loader(self, samples: list, length, filler, collate: Collate) -> DataLoader:
        """``samples`` once each, sorted by ``length`` (like lengths batched: less padding); on several ranks
        each takes its share (``EvaluationShares``), the shorter shares filled up with ``filler`` of the
        first sample."""
        samples = sorted(samples, key=length)
        dataset, sampler = _ListDataset(samples), None
        world, rank = _world_and_rank()
        if world > 1 and samples:
            dataset = _ListDataset([*samples, filler(samples[0])])
            sampler = EvaluationShares(dataset, world, rank)
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler, collate_fn=collate)

    def most_popular(self, stage: str = "test") -> dict[str, dict[str, float]]:
        """The most-popular baseline's ``data.evaluation`` metrics on the ``val`` or ``test`` items:
        items scored by their count in the training histories."""
        stages = {"val": self.validation, "test": self.test}
        if stage not in stages:
            raise ValueError(f"unknown stage {stage!r}; valid: {', '.join(stages)}")
        pairs = stages[stage]
        train = [h.items for h in self.train_histories]
        return mean_metrics(most_popular_ranks(train, pairs, self.num_items))


class SyntheticHistories(HistoryDataModule):
    """Histories shaped like the seed's benchmark: zipf(alpha) lengths up to ``max_seq_len``, zipf item
    popularity (at least 4 events each, what leave-two-out keeps), five action types, increasing timestamps;
    seeded and reproducible."""

    def __init__(self, num_users: int = 512, num_items: int = 2000, alpha: float = 1.2, **kwargs):
        super().__init__(**kwargs)
        self._users, self._items, self.alpha = num_users, num_items, alpha

    @property
    def split(self) -> str:
        """The draw's settings too (``max_seq_len`` bounds the drawn lengths: another one draws other data)."""
        return (
            f"SyntheticHistories (alpha {self.alpha:g}, seed {self.seed}, lengths up to {self.max_seq_len}; "
            f"{self.counts}), leave-two-out"
        )

    def load(self) -> list[History]:
        rng = random.Random(self.seed)
        length_weights = [1 / n**self.alpha for n in range(1, self.max_seq_len + 2)]
        item_weights = [1 / n**self.alpha for n in range(1, self._items + 1)]
        histories = []
        for user in range(1, self._users + 1):
            n = max(4, rng.choices(range(1, self.max_seq_len + 2), weights=length_weights)[0])
            items = rng.choices(range(1, self._items + 1), weights=item_weights, k=n)
            times = [0]
            for _ in range(n - 1):
                times.append(times[-1] + int(rng.expovariate(1 / 3600)))
            histories.append(History(user, tuple(items), tuple(rng.randrange(5) for _ in items), tuple(times)))
        return histories
