"""Fits the toy recommender (no sharded tables: its checkpoints are one file) on two processes under
``HSTUPipelineStrategy``, saving ``step=N.ckpt`` every 2 steps, where rank 0's write of ``step=4.ckpt``
fails halfway (a full disk); run by test_faults_checkpoint.py (two CPU processes, gloo).

    python save_fails_two_ranks.py OUT_DIR

Each rank that sees the save's error prints ``rank R: <the error>`` on stderr and exits 1; a rank left
waiting for the others would hang until the test's timeout.
"""

import argparse
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hstu import HSTUPipelineStrategy
from lightning_hstu.data.toy import ToyDataModule
from lightning_hstu.models.toy import ToyRecommender

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' helpers
from lightning_runs import QUIET, end_process_groups, end_rank_script  # noqa: E402


def fail_halfway_into(name: str) -> None:
    save = torch.save

    def failing_save(obj, f, *args, **kwargs):
        if name not in getattr(f, "name", str(f)):
            return save(obj, f, *args, **kwargs)
        f.write(b"half a checkpoint")
        raise OSError("no space left on device (injected)")

    torch.save = failing_save


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy=HSTUPipelineStrategy("legacy_none", step_timeout=120),
        accelerator="cpu",
        devices=2,
        max_steps=6,
        **{**QUIET, "enable_checkpointing": True},
        limit_val_batches=0,
        callbacks=[ModelCheckpoint(dirpath=args.out_dir, every_n_train_steps=2, save_top_k=-1, filename="{step}")],
    )
    if trainer.global_rank == 0:
        fail_halfway_into("step=4.ckpt")
    try:
        trainer.fit(ToyRecommender(), ToyDataModule(num_samples=128))
    except Exception as error:
        print(f"rank {trainer.global_rank}: {error}", file=sys.stderr, flush=True)
        end_process_groups()
        sys.exit(1)
    end_rank_script()


if __name__ == "__main__":
    main()
