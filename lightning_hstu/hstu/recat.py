"""TorchRec's feature-reordering index of the KJT all-to-all, built once per arguments.

Each batch's ``wait_input_dist`` makes a ``KJTAllToAllTensorsAwaitable``, whose constructor builds the index
that reorders the received features (``torchrec.distributed.dist_data._get_recat``) as
``torch.tensor(python_list, device=device)``: a copy from pageable host memory that waits for the whole
queue of the thread's current stream (``cudaStreamSynchronize``), every step, for a tensor that depends on
its arguments only (features per rank, ranks, stagger, device, batch size per rank). On the light step with
graphs on one H200 it was one of the three host waits per step left (``profile_user_path.py --sync-debug``),
and cost 1.08 and 0.38 ms per step in two rounds (BENCHMARKS.md). ``memoize`` replaces the function in
TorchRec's module, once per process, by one that returns the same tensor for the same arguments: TorchRec
only reads it (permute indices, and the sequence output's backward reorder).
"""

import threading

import torch
import torchrec.distributed.dist_data as dist_data

MAX_ENTRIES = 256
"""Distinct argument sets kept (each batch size per rank is one); past it, built anew each call."""

_lock = threading.Lock()


class _Memoized:
    """``build`` (TorchRec's ``_get_recat``) with its results kept per arguments."""

    def __init__(self, build):
        self.build = build
        self.built: dict[tuple, torch.Tensor | None] = {}

    def __call__(
        self,
        local_split: int,
        num_splits: int,
        stagger: int = 1,
        device: torch.device | None = None,
        batch_size_per_rank: list[int] | None = None,
    ) -> torch.Tensor | None:
        sizes = None if batch_size_per_rank is None else tuple(batch_size_per_rank)
        key = (local_split, num_splits, stagger, None if device is None else torch.device(device), sizes)
        if key in self.built:
            return self.built[key]
        recat = self.build(local_split, num_splits, stagger, device, batch_size_per_rank)
        if len(self.built) < MAX_ENTRIES:
            self.built[key] = recat  # a race builds it twice; either result is the same
        return recat


def memoize() -> None:
    """Installs the memoized ``_get_recat`` in TorchRec's ``dist_data`` (idempotent); a TorchRec without
    that function is left as it is."""
    with _lock:
        current = getattr(dist_data, "_get_recat", None)
        if current is not None and not isinstance(current, _Memoized):
            dist_data._get_recat = _Memoized(current)
