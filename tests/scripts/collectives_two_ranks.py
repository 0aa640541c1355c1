"""Fits the toy recommender on two gloo processes, once per STRATEGY, with the collectives a Lightning user
issues: ``self.all_gather`` in training_step (on the engine's compute thread under the strategy), values
logged with ``sync_dist=True`` every step and per epoch, a validation metric synced across ranks that
EarlyStopping reads, and a callback that all-gathers and waits at a barrier at each epoch end; run by
test_strategy_ranks.py.

    python collectives_two_ranks.py OUT_DIR STRATEGY [STRATEGY ...]

Each rank saves, per fit, its weights, the batches it trained, the global step, what the callbacks saw and
the callback metrics to OUT_DIR/<STRATEGY>.rank<R>.pt.
"""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping
from torch import nn

from lightning_hstu import HSTUPipelineStrategy  # (importing lightning_hstu registers the hstu_* strategies)
from lightning_hstu.data.toy import ToyDataModule
from lightning_hstu.models.toy import ToyRecommender

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' helpers
from lightning_runs import QUIET, end_rank_script  # noqa: E402


class Gathering(ToyRecommender):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        losses = self.all_gather(loss.detach())  # both ranks' losses, in the step
        self.log("both_ranks_loss", losses.mean(), sync_dist=True)
        self.log("epoch_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        items, ratings = batch
        self.log("val_loss", nn.functional.mse_loss(self(items), ratings), sync_dist=True)


class EpochEnds(pl.Callback):
    """Every rank's global step, all-gathered at each epoch end, then a barrier; and the losses of each batch."""

    def __init__(self):
        self.gathered, self.losses = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_train_epoch_end(self, trainer, pl_module):
        value = torch.tensor(trainer.global_step + 100 * trainer.global_rank)
        self.gathered.append(pl_module.all_gather(value).tolist())
        trainer.strategy.barrier()


def fit(strategy: str, out_dir: str) -> None:
    pl.seed_everything(0, verbose=False)
    model, ends = Gathering(), EpochEnds()
    trainer = pl.Trainer(
        strategy=strategy if strategy == "ddp" else HSTUPipelineStrategy(strategy),
        accelerator="cpu",
        devices=2,
        max_epochs=4,
        val_check_interval=0.5,
        limit_val_batches=2,
        **QUIET,
        callbacks=[ends, EarlyStopping("val_loss", patience=0, min_delta=0.05)],
    )
    trainer.fit(model, ToyDataModule(num_samples=128))
    torch.save(
        {
            "weights": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "seen": model.batches_seen,
            "global_step": trainer.global_step,
            "gathered": ends.gathered,
            "losses": ends.losses,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        },
        f"{out_dir}/{strategy}.rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    for name in sys.argv[2:]:
        fit(name, sys.argv[1])
    end_rank_script()
