"""TorchRec's feature-reordering index of the KJT all-to-all, built once per arguments, without a wait for
the GPU.

Each batch's ``wait_input_dist`` makes a ``KJTAllToAllTensorsAwaitable``, whose constructor builds the index
that reorders the received features (``torchrec.distributed.dist_data._get_recat``) as
``torch.tensor(python_list, device=device)``: a copy from pageable host memory that waits for the whole
queue of the thread's current stream (``cudaStreamSynchronize``), for a tensor that depends on its arguments
only (features per rank, ranks, stagger, device, batch size per rank). On the light step with graphs on one
H200 it was one of the three host waits per step left (``profile_user_path.py --sync-debug``), and cost 1.08
and 0.38 ms per step in two rounds (BENCHMARKS.md). ``memoize`` replaces the function in TorchRec's module,
once per process, by one that returns the same tensor for the same arguments (TorchRec only reads it:
permute indices, and the sequence output's backward reorder), and that builds a new one on the host and
copies it to the device from pinned memory, queued on the device's current stream as TorchRec's copy
was, so that a miss waits for nothing either (a read from another stream waits, on the device, for the
copy).

The batch sizes per rank are the KJT's strides, which ``in_bags`` makes the batch's number of bags: they
change from batch to batch (1,226 values from 107 to 2,189 in 5,000 batches of the seed's workload).
TorchRec's index depends on them only where the ranks' sizes differ; where they are equal (always on one
rank) they are left out of the key, so that one rank builds one index per feature split whatever its
batches.
"""

import threading

import torch
import torchrec.distributed.dist_data as dist_data

MAX_ENTRIES = 256
"""Distinct argument sets kept (on several ranks, each combination of unequal batch sizes per rank is one);
past it, built anew each call (on the host, copied without a wait)."""

_lock = threading.Lock()


def _key_sizes(batch_size_per_rank: list[int] | None) -> tuple[int, ...] | None:
    """The batch sizes per rank as the index depends on them: not at all where they are all equal."""
    if batch_size_per_rank is None or all(size == batch_size_per_rank[0] for size in batch_size_per_rank):
        return None
    return tuple(batch_size_per_rank)


class _Memoized:
    """``build`` (TorchRec's ``_get_recat``) with its results kept per arguments."""

    def __init__(self, build):
        self.build = build
        self.built: dict[tuple, torch.Tensor | None] = {}
        self._copies: dict[tuple, torch.cuda.Event] = {}  # kept indices whose copy may not have run yet

    def __call__(
        self,
        local_split: int,
        num_splits: int,
        stagger: int = 1,
        device: torch.device | None = None,
        batch_size_per_rank: list[int] | None = None,
    ) -> torch.Tensor | None:
        device = None if device is None else torch.device(device)
        key = (local_split, num_splits, stagger, device, _key_sizes(batch_size_per_rank))
        if key in self.built:
            self._after_copy(key, device)
            return self.built[key]
        recat, copied = self._build(local_split, num_splits, stagger, device, batch_size_per_rank)
        if len(self.built) < MAX_ENTRIES:
            if copied is not None:
                self._copies[key] = copied
            self.built[key] = recat  # a race builds it twice; either result is the same
        return recat

    def _build(self, local_split, num_splits, stagger, device, batch_size_per_rank):
        """The index, and the event after its copy to the device (None where it was not copied so)."""
        if device is None or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return self.build(local_split, num_splits, stagger, device, batch_size_per_rank), None
        on_host = self.build(local_split, num_splits, stagger, None, batch_size_per_rank)
        if on_host is None:
            return None, None
        # queued on the device's current stream, as TorchRec's copy was: its readers there follow it in stream
        # order, and the pinned buffer stays the copy's until it has run (torch's caching host allocator)
        recat = on_host.pin_memory().to(device, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(device))
        return recat, copied

    def _after_copy(self, key: tuple, device: torch.device) -> None:
        """A kept index read from another stream than its copy's: that stream waits for the copy (on the
        device) until the copy is known to have run."""
        copied = self._copies.get(key)
        if copied is None:
            return
        if copied.query():
            self._copies.pop(key, None)
        else:
            torch.cuda.current_stream(device).wait_event(copied)


def memoize() -> None:
    """Installs the memoized ``_get_recat`` in TorchRec's ``dist_data`` (idempotent); a TorchRec without
    that function is left as it is."""
    with _lock:
        current = getattr(dist_data, "_get_recat", None)
        if current is not None and not isinstance(current, _Memoized):
            dist_data._get_recat = _Memoized(current)
