"""The input distribution's reorder index (TorchRec's ``_get_recat``) is built once per arguments, with the
values TorchRec builds."""

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


def test_the_reorder_index_is_torchrecs_and_built_once_per_arguments():
    recat.memoize()
    recat.memoize()  # idempotent: still one layer over TorchRec's function
    memoized = dist_data._get_recat
    assert isinstance(memoized, recat._Memoized) and not isinstance(memoized.build, recat._Memoized)
    for case in CASES:
        expected = memoized.build(**case)
        got = memoized(**case)
        if expected is None:
            assert got is None, case
        else:
            assert torch.equal(got, expected) and got.dtype == expected.dtype, case
        assert memoized(**case) is got, case  # the same tensor: no second build, no second copy to the device
    assert memoized(local_split=3, num_splits=2, batch_size_per_rank=[4, 6]) is not memoized(
        local_split=3, num_splits=2, batch_size_per_rank=[6, 4]
    )
