"""Seeded item sequences with ratings, for the toy recommender."""

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class ToyDataModule(pl.LightningDataModule):
    """``num_samples`` sequences of ``seq_len`` item ids; the rating depends on the items.

    ``shuffle`` draws a new order each epoch from a seeded generator (deterministic across runs);
    ``stateful`` serves the data through torchdata's ``StatefulDataLoader``, whose position a checkpoint
    saves.
    """

    def __init__(
        self,
        num_samples: int = 96,
        batch_size: int = 8,
        num_items: int = 64,
        seq_len: int = 6,
        seed: int = 0,
        shuffle: bool = False,
        stateful: bool = False,
    ):
        super().__init__()
        self.save_hyperparameters()
        gen = torch.Generator().manual_seed(seed)
        self.items = torch.randint(0, num_items, (num_samples, seq_len), generator=gen)
        weights = torch.linspace(-1, 1, num_items)
        self.ratings = weights[self.items].mean(dim=1) + 0.1 * torch.randn(num_samples, generator=gen)

    def train_dataloader(self):
        return self._loader(TensorDataset(self.items, self.ratings), shuffle=self.hparams.shuffle)

    def val_dataloader(self):
        n = max(self.hparams.batch_size, len(self.items) // 4)
        return self._loader(TensorDataset(self.items[:n], self.ratings[:n]), shuffle=False)

    def _loader(self, dataset, shuffle: bool):
        gen = torch.Generator().manual_seed(self.hparams.seed) if shuffle else None
        if self.hparams.stateful:
            from torchdata.stateful_dataloader import StatefulDataLoader

            return StatefulDataLoader(dataset, batch_size=self.hparams.batch_size, shuffle=shuffle, generator=gen)
        return DataLoader(dataset, batch_size=self.hparams.batch_size, shuffle=shuffle, generator=gen)
