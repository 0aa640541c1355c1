"""Ranking metrics of a held-out next item, the same for every model and the most-popular baseline.

Each held-out item gets a 0-based rank under two rankings: among all items (id 0, no item, excluded), and
among the items not in the user's history (every item the user rated before the held-out one, also those
before a history cut to ``max_seq_len``; the held-out item itself always counts). From the ranks: HR@k (the
item in the top k), NDCG@k (1 / log2(rank + 2) in the top k, else 0) and MRR (1 / (rank + 1)), averaged
over users. An item scored the same as the held-out item ranks above it,
and so does an item scored NaN; a NaN held-out score ranks last: a model that scores everything alike, or
diverged, gets the worst ranks, never the best.
"""

from collections import Counter
from collections.abc import Sequence

import torch

RANKINGS = {"all": "ranked among all items", "unseen": "ranked among items not in the user's history"}
METRICS = ("HR@1", "HR@10", "HR@50", "NDCG@10", "NDCG@50", "MRR")
NO_TARGET = 0
"""The target of a filler sample (id 0 is no item): evaluated like the others, counted in no metric."""


def held_items(like: torch.Tensor, items: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A bool tensor shaped as ``like`` ([B, items + 1]): True at each sample's ``items`` (the ids of every
    sample back to back, ``lengths`` [B] of them per sample)."""
    held = torch.zeros(like.shape, dtype=torch.bool, device=like.device)
    held[torch.repeat_interleave(torch.arange(len(like), device=like.device), lengths), items] = True
    return held


def target_ranks(
    scores: torch.Tensor, targets: torch.Tensor, history: torch.Tensor, history_lengths: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The 0-based rank of each target under each of ``RANKINGS``. ``scores`` [B, items + 1] (float64 kept,
    others as float32), ``targets`` [B], ``history`` the item ids of every history back to back,
    ``history_lengths`` [B]."""
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    samples = torch.arange(len(targets), device=scores.device)
    target = scores.gather(1, targets[:, None])
    above = (scores >= target) | scores.isnan() | target.isnan()  # ties and NaN against the target
    above[:, 0] = False  # id 0 is no item
    above[samples, targets] = False  # the target itself
    seen = held_items(above, history, history_lengths)
    seen[samples, targets] = False
    return {"all": above.sum(1), "unseen": (above & ~seen).sum(1)}


def metric_values(ranks: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each of ``METRICS`` per sample (average them over samples)."""
    rank = ranks.float()
    gain = 1 / torch.log2(rank + 2)
    return {
        "HR@1": (rank < 1).float(),
        "HR@10": (rank < 10).float(),
        "HR@50": (rank < 50).float(),
        "NDCG@10": gain * (rank < 10),
        "NDCG@50": gain * (rank < 50),
        "MRR": 1 / (rank + 1),
    }


def mean_metrics(ranks: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """{ranking: {metric: mean}} of ``target_ranks``' output."""
    return {ranking: {name: float(v.mean()) for name, v in metric_values(r).items()} for ranking, r in ranks.items()}


def most_popular_ranks(train_items: Sequence[Sequence[int]], evaluation, num_items: int) -> dict[str, torch.Tensor]:
    """``target_ranks`` of the baseline that scores every item by how often it occurs in ``train_items``
    (ties: the smaller id first); ``evaluation`` holds (history, held-out item) pairs."""
    counts = Counter(i for items in train_items for i in items)
    popularity = torch.zeros(num_items + 1, dtype=torch.float64)
    for item, count in counts.items():
        popularity[item] = count
    ids = torch.arange(num_items + 1, dtype=torch.float64)
    scores = popularity * (num_items + 1) - ids  # ties: the smaller id first, exactly (integers in float64)
    ranks = {name: [] for name in RANKINGS}
    for start in range(0, len(evaluation), 256):
        chunk = evaluation[start : start + 256]
        history = torch.tensor([i for h, _ in chunk for i in h.items + h.earlier], dtype=torch.long)
        lengths = torch.tensor([len(h.items) + len(h.earlier) for h, _ in chunk])
        targets = torch.tensor([t for _, t in chunk])
        for name, r in target_ranks(scores.expand(len(chunk), -1), targets, history, lengths).items():
            ranks[name].append(r)
    return {name: torch.cat(r) for name, r in ranks.items()}
