"""The batches of one training epoch, pulled from Lightning's data fetcher for the engine's ring."""

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.loops.fetchers import _DataFetcher
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch.utils.data import IterableDataset


class EpochBatches:
    """Yields the epoch's batches to the engine, which pulls ``depth - 1`` of them ahead of training.

    - It stops at the epoch's batch count (``limit_train_batches``), so the ring never pulls a batch the
      epoch will not train.
    - Ranks agree on the end of data: for each batch every rank says whether it has one, and all stop
      at the first rank's end (``ask_all_ranks_have``), so a rank with fewer batches never hangs the others.
      A rank that reaches its own batch count (a loader with a length, or ``limit_train_batches``) says so
      too, rather than leaving the others waiting for its answer. The rank whose batches are left
      untrained warns. The question about a batch is asked when it is pulled, and answered when the batch
      after it has been pulled and asked about: the loader runs one batch further ahead, and a rank waits
      for the others' answer about a batch only while it pulls the next one (every rank asks as many times:
      each pull of the engine asks once, the first twice, until the first answer "not every rank").
    - For stateful loaders it keeps the loader's state after each pull, keyed by how many batches the
      loader has produced in the epoch: a checkpoint saves the state from before the oldest batch not yet
      trained, not the state of a loader that is already ``depth`` batches ahead. Once every batch of the
      epoch is trained, the state saved is the one the next epoch starts from: the loaders' state after they
      ended, or, where the epoch ended first (``limit_train_batches``, a shorter rank), none for loaders of
      map-style datasets (a new pass from the start, as a new iterator of the uninterrupted fit makes). The
      state after the last batch's pull would make the resumed fit's next epoch the rest of this one: nothing,
      or the batches past the limit (under Lightning's own loop a checkpoint saved at the epoch's last batch
      end resumes so). Other loaders (of iterable datasets, or without a dataset) keep that state: a stream
      goes on where it was.
    """

    def __init__(
        self,
        fetcher: _DataFetcher,
        *,
        start: int,
        stop: int | float,
        keep_states: int,
        ask_all_ranks_have: Callable[[bool], Callable[[], bool]],
    ):
        self.start = start
        """Batches of this epoch trained before this run began (a mid-epoch resume)."""
        self.count: int | None = None
        """Batches this run yields, known once the data (or the epoch's limit) has ended."""
        self._fetcher = fetcher
        self._stop = stop
        self._ask_all_ranks_have = ask_all_ranks_have
        loader = fetcher.combined_loader
        self._stateful = _stateful(loader)
        self._keep_states = keep_states
        self._states: dict[int, list[dict[str, Any]]] = {}
        self._ended_state: list[dict[str, Any]] | None = None  # after the loaders' StopIteration
        self._map_style = _map_style(loader)

    @property
    def stateful(self) -> bool:
        return self._stateful

    def batch_sizes(self) -> list[int | None]:
        """Each train loader's batch size (None where a batch sampler decides it)."""
        return batch_sizes(self._fetcher.combined_loader)

    def describe(self) -> str:
        """The loaders, named for a report: ``train dataloader (DataLoader of MyDataset)``."""
        loaders = [
            f"{type(loader).__name__} of {type(getattr(loader, 'dataset', None)).__name__}"
            for loader in self._fetcher.combined_loader.flattened
        ]
        return f"train dataloader ({', '.join(loaders)})"

    def skip(self, batches: int) -> None:
        """Fast-forward a loader without state past the batches trained before a mid-epoch resume."""
        for skipped in range(batches):
            try:
                next(self._fetcher)
            except StopIteration:
                raise RuntimeError(
                    f"resuming mid-epoch needs {batches} batches to skip, but the train "
                    f"dataloader ended after {skipped}: it is not the loader of the run "
                    f"that saved the checkpoint"
                ) from None

    def __iter__(self) -> Iterator[Any]:
        self._snapshot()
        index = self.start  # the batch the next pull gives
        ended = False  # this rank has no batch left this epoch (its count reached, or its loader exhausted)
        asked: tuple[Any, bool, Callable[[], bool]] | None = None  # the batch pulled before, and its question
        while True:
            batch, has_batch = None, False
            if not ended and index < self._stop:
                try:
                    batch, _, _ = next(self._fetcher)
                    has_batch = True
                    self._snapshot()
                except StopIteration:
                    if self._stateful:
                        self._ended_state = self._fetcher.combined_loader._state_dicts()
            # after its end a rank still answers "no", until every rank has read "not every rank has a batch"
            ended = not has_batch
            answer = self._ask_all_ranks_have(has_batch)
            if asked is not None:
                earlier, had, everyone = asked
                if not everyone():
                    answer()  # asked by every rank: closed here, not left open
                    if had:
                        _warn_untrained(index - 1)
                    break
                yield earlier
            asked = (batch, has_batch, answer)
            index += 1
        self.count = index - 1 - self.start  # every batch before the last one asked about

    def loader_state(self, produced: int) -> list[dict[str, Any]] | None:
        """The stateful loaders' state when they had produced ``produced`` batches of this epoch; once that is
        every batch of the epoch, the state the next epoch starts from (see the class)."""
        if produced >= self._stop or (self.count is not None and produced >= self.start + self.count):
            if self._ended_state is not None:
                return self._ended_state
            if self._map_style:
                return []  # none: fresh loaders, a new pass
        return self._states.get(produced)

    def _snapshot(self) -> None:
        if not self._stateful:
            return
        produced = self._fetcher.fetched
        self._states[produced] = self._fetcher.combined_loader._state_dicts()
        for old in [n for n in self._states if n < produced - self._keep_states]:
            del self._states[old]


def new_pass(fetcher: _DataFetcher) -> None:
    """Make ``fetcher``'s loaders start a new pass where they are stateful loaders of map-style datasets.

    For a fit that resumes from a checkpoint saved at the end of an epoch's last batch, Lightning makes the
    loaders' iterators (to restore their state) before it gives their samplers the new epoch, and then
    trains the new epoch from those iterators: a ``StatefulDataLoader`` has drawn its sampler's order by then,
    so under a ``DistributedSampler`` it would train the new epoch in the ended epoch's order. A plain
    ``DataLoader`` draws its order at the first batch, after the sampler got its epoch; a stream goes on from
    its restored state, which a new iterator would skip past."""
    loaders = fetcher.combined_loader
    if _stateful(loaders) and _map_style(loaders):
        iter(fetcher)


def _stateful(loaders: CombinedLoader) -> bool:
    """Whether any of ``loaders`` keeps a state (a checkpoint saves it)."""
    return any(isinstance(loader, _Stateful) for loader in loaders.flattened)


def _map_style(loaders: CombinedLoader) -> bool:
    """Whether every one of ``loaders`` has an indexed dataset (a new iterator makes a new pass from the start)."""
    datasets = [getattr(loader, "dataset", None) for loader in loaders.flattened]
    return all(
        not isinstance(d, IterableDataset) and hasattr(d, "__len__") and hasattr(d, "__getitem__") for d in datasets
    )


def batch_sizes(loaders: CombinedLoader) -> list[int | None]:
    """Each of ``loaders``' batch size (None where a batch sampler decides it)."""
    return [getattr(loader, "batch_size", None) for loader in loaders.flattened]


def record_shares(state: dict[str, Any], sizes: list[int | None], world_size: int) -> None:
    """Put into an epoch loop's checkpoint state what a mid-epoch resume checks before it skips the batches
    trained (``EngineEpochLoop._check_resume``): the train loaders' batch sizes and the number of ranks."""
    state[BATCH_SIZES_KEY] = sizes
    state[WORLD_SIZE_KEY] = world_size


BATCH_SIZES_KEY = "hstu_batch_sizes"
WORLD_SIZE_KEY = "hstu_world_size"


def _warn_untrained(index: int) -> None:
    """On the rank whose batches are left untrained (any rank: not only rank 0's warnings are shown)."""
    rank = f"rank {dist.get_rank()}: " if dist.is_available() and dist.is_initialized() else ""
    warnings.warn(
        f"{rank}another rank ran out of training data first; every rank ends the epoch at batch {index}, so "
        "the rest of this rank's batches are not trained this epoch",
        stacklevel=3,
    )
