"""The workload-balanced batch shuffler: every rank ends up with an equal number of samples and, as far as
an equal-size partition allows, an equal share of the HSTU attention cost.

Two halves, so that the engine can run them as two tasks with other work in between:
``start`` (start_shuffle) all-gathers the per-sample costs without waiting; ``finish`` (finish_shuffle)
partitions the global batch (Karmarkar-Karp, identical on every rank), all-gathers the batch itself (KJT
lengths, then values padded to the longest rank: an all-gather-v that gloo can do too) and keeps this
rank's share.
"""

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .balance import Balance, hstu_cost, imbalance, karmarkar_karp
from .batch import HSTUBatch


@dataclass
class PendingShuffle:
    batch: HSTUBatch
    costs: list[torch.Tensor]
    """One tensor of per-sample costs per rank (filled when ``work`` completes)."""
    work: Any = None


class BalancedShuffler:
    """Balances each global batch across the ranks of ``group``; the identity on one rank or when disabled.

    ``local_batch_size``: every rank's batches must have exactly this many samples (a loader with
    ``drop_last=True``), since the all-gathers exchange fixed-size pieces.
    """

    def __init__(self, local_batch_size: int, group: Any = None, enabled: bool = True):
        self.local_batch_size = local_batch_size
        self.group = group
        distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        self.active = enabled and self.world > 1
        self.last_balance: Balance | None = None

    def start(self, batch: HSTUBatch) -> PendingShuffle:
        costs = batch.sequence_lengths().to(torch.int64)
        costs = costs * costs  # hstu_cost, vectorised
        if not self.active:
            return PendingShuffle(batch, [costs])
        if batch.size != self.local_batch_size:
            raise ValueError(
                f"balanced shuffling needs batches of local_batch_size={self.local_batch_size} "
                f"samples on every rank, got {batch.size} (use drop_last=True, or disable it)"
            )
        gathered = [torch.empty_like(costs) for _ in range(self.world)]
        work = dist.all_gather(gathered, costs, group=self.group, async_op=True)
        return PendingShuffle(batch, gathered, work)

    def finish(self, pending: PendingShuffle) -> HSTUBatch:
        if not self.active:
            self.last_balance = Balance(1.0, 1.0)
            return pending.batch
        pending.work.wait()
        costs = torch.cat(pending.costs).tolist()
        shares = karmarkar_karp(costs, self.world)
        everyone = self._all_gather_batches(pending.batch)
        as_loaded = [range(r * self.local_batch_size, (r + 1) * self.local_batch_size) for r in range(self.world)]
        self.last_balance = Balance(imbalance(costs, as_loaded), imbalance(costs, shares))
        mine = torch.tensor(shares[self.rank], dtype=torch.int64, device=pending.batch.features.device())
        return HSTUBatch.concat(everyone).select(mine)

    def _all_gather_batches(self, batch: HSTUBatch) -> list[HSTUBatch]:
        features = batch.features
        lengths = [torch.empty_like(features.lengths()) for _ in range(self.world)]
        dist.all_gather(lengths, features.lengths(), group=self.group)
        totals = [int(n.sum()) for n in lengths]
        values = features.values()
        padded = torch.zeros(max(totals), dtype=values.dtype, device=values.device)
        padded[: len(values)] = values
        gathered = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(gathered, padded, group=self.group)
        keys = features.keys()
        return [batch._with(keys, [v[:total]], [n]) for v, n, total in zip(gathered, lengths, totals)]


def shuffle_group(enabled: bool = True, timeout: "datetime.timedelta | None" = None):
    """A process group of its own for the balanced shuffler's all-gathers (None on one rank or when the
    shuffler is off). On the step's group, NCCL would run them behind that group's earlier collectives (the
    previous step's all-to-alls and gradient all-reduce), so the shuffle, which reads the gathered sizes on
    the host, would wait for the previous step's backward on the GPU; on its own group it waits only for the
    ranks' own all-gather. Every rank launches the group's collectives in the same order (one task at a
    time, in batch order), as each group needs. Called on every rank, in the same order (it is a collective);
    ``timeout``: the group's (the strategy's ``process_group_timeout``; None: torch's default)."""
    if not (enabled and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    return dist.new_group(timeout=timeout)


__all__ = ["BalancedShuffler", "PendingShuffle", "hstu_cost", "shuffle_group"]
