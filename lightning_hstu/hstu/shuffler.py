"""The workload-balanced batch shuffler: every rank ends up with an equal number of samples and, as far as
an equal-size partition allows, an equal share of the HSTU attention cost.

Two halves, so that the engine can run them as two tasks with other work in between:
``start`` (start_shuffle) all-gathers every rank's feature lengths without waiting, from host memory on a
host (gloo) group where the batch came from the host; ``finish`` (finish_shuffle) partitions the global
batch (Karmarkar-Karp on the squared history lengths, identical on every rank), all-gathers the batch's
values (padded to the longest rank's: an all-gather-v that gloo can do too) and keeps this rank's share.
Every size is known on the host from the lengths, so on a GPU nothing in either half waits for the device.
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
    lengths: list[torch.Tensor]
    """Every rank's feature lengths (filled when ``work`` completes)."""
    work: Any = None


class BalancedShuffler:
    """Balances each global batch across the ranks of ``group``; the identity on one rank or when disabled.

    ``local_batch_size``: every rank's batches must have exactly this many samples (a loader with
    ``drop_last=True``), since the all-gathers exchange fixed-size pieces. ``sizes_group``: a group over the
    same ranks for the lengths' all-gather; a gloo one takes them from host memory (``shuffle_group(...,
    backend="gloo")``), otherwise they are gathered on ``group`` (on NCCL: from the GPU, a wait for it).
    """

    def __init__(self, local_batch_size: int, group: Any = None, enabled: bool = True, sizes_group: Any = None):
        self.local_batch_size = local_batch_size
        self.group = group
        distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        self.active = enabled and self.world > 1
        self.sizes_group = sizes_group if sizes_group is not None else group
        self._on_nccl = self.active and dist.get_backend(group) == "nccl"
        self._sizes_on_device = self.active and dist.get_backend(self.sizes_group) == "nccl"
        self.last_balance: Balance | None = None

    def start(self, batch: HSTUBatch) -> PendingShuffle:
        if not self.active:
            return PendingShuffle(batch, [])
        if batch.size != self.local_batch_size:
            raise ValueError(
                f"balanced shuffling needs batches of local_batch_size={self.local_batch_size} "
                f"samples on every rank, got {batch.size} (use drop_last=True, or disable it)"
            )
        lengths = batch.lengths_on_host().to(torch.int64)
        if self._sizes_on_device:
            lengths = lengths.to(batch.features.device(), non_blocking=True)
        gathered = [torch.empty_like(lengths) for _ in range(self.world)]
        work = dist.all_gather(gathered, lengths, group=self.sizes_group, async_op=True)
        return PendingShuffle(batch, gathered, work)

    def finish(self, pending: PendingShuffle) -> HSTUBatch:
        if not self.active:
            self.last_balance = Balance(1.0, 1.0)
            return pending.batch
        pending.work.wait()
        batch = pending.batch
        keys = batch.features.keys()
        lengths = torch.stack(pending.lengths).cpu().view(self.world, len(keys), self.local_batch_size)
        sequence = lengths[:, keys.index(batch.sequence_keys[0])].flatten()
        costs = (sequence * sequence).tolist()  # hstu_cost, vectorised
        shares = karmarkar_karp(costs, self.world)
        as_loaded = [range(r * self.local_batch_size, (r + 1) * self.local_batch_size) for r in range(self.world)]
        self.last_balance = Balance(imbalance(costs, as_loaded), imbalance(costs, shares))
        width = int(lengths.flatten(1).sum(1).max())
        everyone = self._all_gather_values(batch.features.values(), width)
        mine = torch.tensor(shares[self.rank])
        return batch.take(everyone, lengths, width, mine // self.local_batch_size, mine % self.local_batch_size)

    def _all_gather_values(self, values: torch.Tensor, width: int) -> torch.Tensor:
        """Every rank's values one after another, each padded to ``width``."""
        padded = torch.cat([values, values.new_zeros(width - values.numel())])
        if self._on_nccl:
            everyone = values.new_empty(self.world * width)
            dist.all_gather_into_tensor(everyone, padded, group=self.group)
            return everyone
        gathered = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(gathered, padded, group=self.group)
        return torch.cat(gathered)


def shuffle_group(enabled: bool = True, timeout: "datetime.timedelta | None" = None, backend: str | None = None):
    """A process group of its own for the balanced shuffler's all-gathers (None on one rank or when the
    shuffler is off); ``backend="gloo"``: the one for the lengths, from host memory. On the step's group,
    NCCL would run the values' all-gather behind that group's earlier collectives (the previous step's
    all-to-alls and gradient all-reduce); on its own group it waits only for the ranks' own all-gather.
    Every rank launches the group's collectives in the same order (one task at a time, in batch order), as
    each group needs. Called on every rank, in the same order (it is a collective); ``timeout``: the
    group's (the strategy's ``process_group_timeout``; None: torch's default)."""
    if not (enabled and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    return dist.new_group(timeout=timeout, backend=backend)


__all__ = ["BalancedShuffler", "PendingShuffle", "hstu_cost", "shuffle_group"]
