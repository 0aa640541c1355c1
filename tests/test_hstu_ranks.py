"""The HSTU workload on two gloo ranks under several presets, for a hundred steps, with the debug mode
that compares every rank's collective sequence (CollectiveInventoryCallback(compare_ranks=True)): the ranks
launch the same collectives in the same order, finish, and agree on the dense weights; a rank that
launches one collective more is reported, by every rank, instead of hanging them."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ranks import launch_env

SCRIPT = Path(__file__).parent / "scripts" / "hstu_ranks.py"
STEPS = 100


def run(preset, out_dir, *args):
    out_dir.mkdir()
    return subprocess.run(
        [sys.executable, str(SCRIPT), preset, str(out_dir), str(STEPS), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=out_dir,
        env=launch_env(),
    )


@pytest.mark.parametrize("preset", ["legacy_none", "per_task_d3", "full_split_d6"])
def test_ranks_launch_the_same_collectives_for_a_hundred_steps(preset, tmp_path):
    result = run(preset, tmp_path / "out")
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for rank in ranks:
        assert rank["global_step"] == STEPS
        assert rank["compared"] == 3
    for name, value in ranks[0]["weights"].items():  # megatron-core's all-reduce keeps the replicas equal
        assert torch.equal(ranks[1]["weights"][name], value), name


def test_a_rank_that_launches_one_collective_more_is_reported(tmp_path):
    result = run("default_d6", tmp_path / "out", "--mismatch")
    assert result.returncode != 0
    assert "collectives differ between ranks" in result.stderr
    assert "rank 1 ('finish_shuffle'" in result.stderr and "'allreduce')" in result.stderr
