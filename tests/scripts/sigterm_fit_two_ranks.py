"""Two gloo ranks fit the toy recommender for two epochs of 16 batches; one rank sends itself SIGTERM at the
start of its batch BATCH of the first epoch (rank 0's launcher passes it on to rank 1, as Lightning's does);
run by test_strategy_ranks.py.

    python sigterm_fit_two_ranks.py OUT_DIR PRESET SIGNALLED_RANK BATCH

Each rank saves to OUT_DIR/rank<R>.pt what ended its fit (the exception's type name, or None), its global
step then, and its weights; Lightning's OnExceptionCheckpoint saves OUT_DIR/on_exception.ckpt.
"""

import os
import signal
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint

from lightning_hstu import HSTUPipelineStrategy
from lightning_hstu.data.toy import ToyDataModule
from lightning_hstu.models.toy import ToyRecommender

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' helpers
from lightning_runs import QUIET, end_rank_script  # noqa: E402


class SignalAtBatch(pl.Callback):
    def __init__(self, rank: int, batch: int):
        self.rank, self.batch = rank, batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.current_epoch == 0 and batch_idx == self.batch:
            os.kill(os.getpid(), signal.SIGTERM)


def main(out_dir: str, preset: str, signalled: int, at_batch: int) -> None:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy=HSTUPipelineStrategy(preset),
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        **{**QUIET, "enable_checkpointing": True},  # for OnExceptionCheckpoint
        limit_val_batches=0,
        callbacks=[SignalAtBatch(signalled, at_batch), OnExceptionCheckpoint(out_dir)],
    )
    model = ToyRecommender()
    ended = None
    try:
        trainer.fit(model, ToyDataModule(num_samples=256))
    except BaseException as error:  # noqa: BLE001 (what ended the fit is the result)
        ended = type(error).__name__
    weights = {name: value.detach().clone() for name, value in model.state_dict().items()}
    result = {"ended": ended, "global_step": trainer.global_step, "weights": weights}
    torch.save(result, f"{out_dir}/rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    end_rank_script()
