"""Checkpoints of the HSTU recommender, whose tables are sharded over the ranks: written by every rank through
torch.distributed.checkpoint, resumed mid-epoch to the run that never stopped (dense weights, table shards,
the fused sparse optimizer's state, the losses), and readable by a different number of ranks."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ranks import launch_env

SCRIPT = Path(__file__).parent / "scripts" / "hstu_resume.py"


def launch(out_dir: Path, max_steps: int, *args: str, devices: int = 2) -> subprocess.CompletedProcess:
    out_dir.mkdir()
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(out_dir), str(max_steps), "--devices", str(devices), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=out_dir,
        env=launch_env(),
    )


def run(out_dir: Path, max_steps: int, *args: str, devices: int = 2) -> list[dict]:
    result = launch(out_dir, max_steps, *args, devices=devices)
    assert result.returncode == 0, result.stderr[-3000:]
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(devices)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Six steps on two ranks (six batches an epoch per rank), checkpointing every three."""
    out = tmp_path_factory.mktemp("hstu") / "run"
    return out, run(out, 6, "--save-every", "3")


def test_the_checkpoint_is_a_directory_of_every_ranks_shards(uninterrupted):
    out, _ = uninterrupted
    checkpoint = out / "step=3.ckpt"
    assert (checkpoint / "lightning.pt").is_file() and (checkpoint / ".metadata").is_file()
    assert sorted(p.name for p in checkpoint.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_resuming_mid_epoch_equals_the_run_that_never_stopped(uninterrupted, tmp_path):
    out, expected = uninterrupted
    resumed = run(tmp_path / "resumed", 6, "--resume", str(out / "step=3.ckpt"))
    for rank, (got, want) in enumerate(zip(resumed, expected)):
        assert got["global_step"] == want["global_step"] == 6
        assert got["losses"] == want["losses"][3:], rank  # the same batches, in the same order
        for part in ("model", "sparse_optimizer"):
            assert got["state"][part].keys() == want["state"][part].keys()
            for name, value in want["state"][part].items():
                assert torch.equal(got["state"][part][name], value), (rank, part, name)


def test_one_rank_reads_the_checkpoint_of_two(uninterrupted, tmp_path):
    out, two_ranks = uninterrupted
    (one_rank,) = run(tmp_path / "one", 6, "--resume", str(out / "step=6.ckpt"), devices=1)  # nothing left to train
    assert one_rank["losses"] == []
    for table in ("item", "user"):
        name = f"embeddings.model_parallel.embeddings.{table}.weight"
        whole = torch.cat([rank["state"]["model"][name] for rank in two_ranks])  # row-wise: rank 0 has the first rows
        assert torch.equal(one_rank["state"]["model"][name], whole), name
    assert torch.equal(
        one_rank["state"]["model"]["objectives.stack.norm.weight"],
        two_ranks[0]["state"]["model"]["objectives.stack.norm.weight"],
    )


def test_a_mid_epoch_checkpoint_of_two_ranks_is_refused_for_training_on_one(uninterrupted, tmp_path):
    """Each rank's share of the epoch depends on the number of ranks: skipping the 3 batches per rank trained
    before the checkpoint would train 24 of the epoch's 96 users twice on one rank (and skip 24 on four)."""
    out, _ = uninterrupted
    result = launch(tmp_path / "one", 12, "--resume", str(out / "step=3.ckpt"), devices=1)
    assert result.returncode != 0
    assert "the checkpoint was saved 3 batches into an epoch on 2 rank(s); this run has 1" in result.stderr


def test_model_checkpoint_removes_the_older_checkpoint_directories(tmp_path):
    run(tmp_path / "kept", 6, "--save-every", "2", "--keep", "1")
    assert sorted(p.name for p in (tmp_path / "kept").glob("*.ckpt")) == ["step=6.ckpt"]
