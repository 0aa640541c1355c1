"""Fits the toy recommender on two processes under ``HSTUPipelineStrategy("legacy_none", step_timeout=60)``,
where rank 1's ``training_step`` raises at batch 3 (with ``validation``: its ``validation_step`` at validation
batch 0 of the first epoch's end; with ``epoch_end``: its ``on_train_epoch_end`` after epoch 0 of two; with
``start``: its ``on_train_start``, before the first epoch) and rank 1's process then stays (as a rank on NCCL
whose peers do not see it end); run by test_watchdog_ranks.py (two CPU processes, gloo).

    python peer_failure_two_ranks.py OUT_DIR [validation | epoch_end | start]

Rank 0's step waits in the gradients' all-reduce for rank 1 (with ``validation``: rank 0's validation, at its
end, in the reduction of the loss logged with ``sync_dist``; with ``epoch_end``: epoch 1's agreement on its
number of batches; with ``start``: epoch 0's), which never comes: the rank that ends it first says why. Each
rank prints ``rank R: <the error's type>: <the error>`` on stderr when its fit raises; rank 0 then ends the
rank it launched, and both exit with status 1 (rank 0 may also be ended by its watchdog).
"""

import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_hstu import HSTUPipelineStrategy
from lightning_hstu.data.toy import ToyDataModule
from lightning_hstu.models.toy import ToyRecommender

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' helpers
from lightning_runs import QUIET  # noqa: E402

VALIDATION = sys.argv[2:] == ["validation"]
EPOCH_END = sys.argv[2:] == ["epoch_end"]
START = sys.argv[2:] == ["start"]


class FailsOnRank1(ToyRecommender):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 3 and not (VALIDATION or EPOCH_END or START):
            raise ValueError("injected failure on rank 1 at batch 3")
        return super().training_step(batch, batch_idx)

    def on_train_start(self):
        if self.global_rank == 1 and START:
            raise ValueError("injected failure on rank 1 before the first epoch")

    def on_train_epoch_end(self):
        if self.global_rank == 1 and EPOCH_END:
            raise ValueError("injected failure on rank 1 at the end of epoch 0")

    def validation_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 0:
            raise ValueError("injected failure on rank 1 at validation batch 0")
        items, ratings = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(items), ratings), sync_dist=True)


def main() -> None:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy=HSTUPipelineStrategy("legacy_none", step_timeout=60),
        accelerator="cpu",
        devices=2,
        max_epochs=2 if EPOCH_END else 1,
        limit_val_batches=4 if VALIDATION else 0,
        **QUIET,
    )
    try:
        trainer.fit(FailsOnRank1(), ToyDataModule(num_samples=128))
    except Exception as error:
        print(f"rank {trainer.global_rank}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        if trainer.global_rank == 1:
            time.sleep(40)  # a rank whose end its peers do not notice (NCCL): they must not wait for it
        for launched in getattr(trainer.strategy.launcher, "procs", None) or []:
            launched.kill()
        sys.exit(1)


if __name__ == "__main__":
    main()
