"""Workload balancing: an equal-size partition of a global batch across ranks by HSTU attention cost.

Pure functions on plain numbers; the shuffler (``shuffler.py``) moves the data.
"""

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


def hstu_cost(length: int) -> int:
    """Relative cost of one sample: HSTU's attention over a sequence grows with the square of its length."""
    return length * length


def karmarkar_karp(costs: Sequence[int], parts: int) -> list[list[int]]:
    """Split sample indices into ``parts`` sets of equal size whose cost sums are as close as the largest
    differencing method (Karmarkar-Karp, k-way, with equal cardinality) gets them.

    Deterministic: every rank computes the same partition from the same all-gathered costs. Each set is
    returned sorted, and the sets ordered by their smallest index.
    """
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    if len(costs) % parts:
        raise ValueError(f"{len(costs)} samples cannot be split into {parts} sets of equal size")
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    # Each group of `parts` consecutive samples (by cost) starts as a partial partition with one sample
    # per set; the two partial partitions with the largest spread are merged repeatedly, pairing the
    # heaviest set of one with the lightest of the other.
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for tie, start in enumerate(range(0, len(order), parts)):
        sets = [(costs[i], [i]) for i in order[start : start + parts]]
        heapq.heappush(heap, (-_spread(sets), tie, sets))
    tie = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda s: s[0])
        b = sorted(b, key=lambda s: -s[0])
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, b)]
        heapq.heappush(heap, (-_spread(merged), tie, merged))
        tie += 1
    sets = [sorted(indices) for _, indices in heap[0][2]] if heap else [[] for _ in range(parts)]
    return sorted(sets, key=lambda s: s[0] if s else len(costs))


def _spread(sets: list[tuple[int, list[int]]]) -> int:
    sums = [s for s, _ in sets]
    return max(sums) - min(sums)


@dataclass(frozen=True)
class Balance:
    """How even the per-rank costs are: max / mean (1.0 is perfect), before and after the shuffle."""

    before: float
    after: float

    def __str__(self) -> str:
        return f"max/mean rank cost {self.before:.3f} -> {self.after:.3f}"


def imbalance(costs: Sequence[int], assignment: Sequence[Sequence[int]]) -> float:
    """max / mean of the per-set cost sums (1.0 when the costs are all zero)."""
    sums = [sum(costs[i] for i in indices) for indices in assignment]
    mean = sum(sums) / len(sums)
    return max(sums) / mean if mean else 1.0
