"""A small recommender LightningModule with nothing HSTU-specific: what "any ordinary LightningModule"
looks like to the strategy. Used by the examples and the tests."""

import lightning.pytorch as pl
import torch
from torch import nn


class ToyRecommender(pl.LightningModule):
    """Mean-pooled item embeddings and an MLP that predict a rating."""

    def __init__(
        self, num_items: int = 64, dim: int = 16, lr: float = 0.05, momentum: float = 0.9, lr_step_size: int = 0
    ):
        super().__init__()
        self.save_hyperparameters()
        self.embedding = nn.Embedding(num_items, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, 1))
        self.batches_seen: list[tuple[int, int]] = []
        """(batch_idx, a fingerprint of the batch) for every training_step, in the order they ran."""

    def forward(self, items: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embedding(items).mean(dim=1)).squeeze(-1)

    def training_step(self, batch, batch_idx):
        items, ratings = batch
        self.batches_seen.append((batch_idx, int(items.sum())))
        loss = nn.functional.mse_loss(self(items), ratings)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        items, ratings = batch
        self.log("val_loss", nn.functional.mse_loss(self(items), ratings))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)
        if not self.hparams.lr_step_size:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, self.hparams.lr_step_size, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
