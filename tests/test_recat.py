"""The input distribution's reorder index (TorchRec's ``_get_recat``) is built once per arguments, with the
values TorchRec builds, and without a wait for the GPU."""

import pytest
import torch
import torchrec.distributed.dist_data as dist_data

from lightning_hstu.hstu import recat

CASES = [
    dict(local_split=2, num_splits=4),
    dict(local_split=2, num_splits=4, stagger=2),
    dict(local_split=0, num_splits=4, stagger=2),  # an empty local split: no index
    dict(local_split=3, num_splits=2, batch_size_per_rank=[4, 6]),  # variable batch per rank
    dict(local_split=3, num_splits=2, batch_size_per_rank=[5, 5]),
    dict(local_split=1, num_splits=1, device=torch.device("cpu"), batch_size_per_rank=[8]),
]


def _memoized() -> recat._Memoized:
    recat.memoize()
    memoized = dist_data._get_recat
    memoized.built.clear()
    memoized._copies.clear()
    return memoized


def _counting(memoized: recat._Memoized, monkeypatch) -> tuple[list, object]:
    """The builds the memo makes from here on, and TorchRec's function (uncounted) to compare with."""
    builds, torchrecs = [], memoized.build
    monkeypatch.setattr(memoized, "build", lambda *args: builds.append(args) or torchrecs(*args))
    return builds, torchrecs


def _same(got, expected, case) -> None:
    if expected is None:
        assert got is None, case
    else:
        assert torch.equal(got.cpu(), expected.cpu()) and got.dtype == expected.dtype, case
        assert got.device == expected.device, case


def test_the_reorder_index_is_torchrecs_and_built_once_per_arguments():
    recat.memoize()
    recat.memoize()  # idempotent: still one layer over TorchRec's function
    memoized = _memoized()
    assert isinstance(memoized, recat._Memoized) and not isinstance(memoized.build, recat._Memoized)
    for case in CASES:
        expected = memoized.build(**case)
        got = memoized(**case)
        _same(got, expected, case)
        assert memoized(**case) is got, case  # the same tensor: no second build, no second copy to the device
    assert memoized(local_split=3, num_splits=2, batch_size_per_rank=[4, 6]) is not memoized(
        local_split=3, num_splits=2, batch_size_per_rank=[6, 4]
    )


def test_equal_batch_sizes_per_rank_share_one_index_whatever_the_size(monkeypatch):
    """The KJT's stride is its number of bags (``in_bags``), which changes from batch to batch: where every
    rank has the same (always on one rank) TorchRec's index does not depend on it, and one is built."""
    memoized = _memoized()
    builds, torchrecs = _counting(memoized, monkeypatch)
    for sizes in ([22], [20], [23], [1000], [22]):
        got = memoized(local_split=4, num_splits=1, batch_size_per_rank=sizes)
        _same(got, torchrecs(local_split=4, num_splits=1, batch_size_per_rank=sizes), sizes)
    for sizes in ([7, 7], [9, 9]):
        got = memoized(local_split=3, num_splits=2, batch_size_per_rank=sizes)
        _same(got, torchrecs(local_split=3, num_splits=2, batch_size_per_rank=sizes), sizes)
    assert len(builds) == 2  # one per split, whatever the (equal) sizes
    for sizes in ([4, 6], [6, 4], [4, 6]):  # unequal sizes: the index depends on them
        got = memoized(local_split=3, num_splits=2, batch_size_per_rank=sizes)
        _same(got, torchrecs(local_split=3, num_splits=2, batch_size_per_rank=sizes), sizes)
    assert len(builds) == 2 + 2


def test_past_its_entries_it_still_gives_torchrecs_index(monkeypatch):
    memoized = _memoized()
    monkeypatch.setattr(recat, "MAX_ENTRIES", 2)
    for first in range(1, 6):
        sizes = [first, first + 1]
        got = memoized(local_split=2, num_splits=2, batch_size_per_rank=sizes)
        _same(got, memoized.build(local_split=2, num_splits=2, batch_size_per_rank=sizes), sizes)
    assert len(memoized.built) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_a_new_index_waits_for_nothing_and_is_torchrecs():
    memoized = _memoized()
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_sync_debug_mode("error")  # a wait for the device raises
    try:
        got = [memoized(**{**case, "device": device}) for case in CASES]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for case, index in zip(CASES, got):
        _same(index, memoized.build(**{**case, "device": device}), case)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_index_read_on_another_stream_before_its_copy_ran_is_read_after_it():
    memoized = _memoized()
    device = torch.device("cuda", torch.cuda.current_device())
    case = dict(local_split=3, num_splits=2, device=device, batch_size_per_rank=[4, 6])
    expected = memoized.build(**case).cpu()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the copy queued behind about 0.1 s of the current stream's work
    memoized(**case)
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        read = memoized(**case).clone()  # a hit from another stream
    torch.cuda.synchronize()
    assert torch.equal(read.cpu(), expected)
