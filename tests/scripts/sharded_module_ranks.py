"""Trains an ordinary LightningModule whose item table TorchRec shards (``ShardedEmbeddings``, no HSTU task
hooks) on two processes; run by test_strategy_ranks.py (two CPU processes, gloo).

    python sharded_module_ranks.py OUT_DIR STRATEGY

STRATEGY ``ddp`` is Lightning's DDP, with the module naming its table shards in
``_ddp_params_and_buffers_to_ignore`` itself (torch DDP cannot wrap them: they are not leaves of autograd,
and each rank holds other rows); a preset name is ``HSTUPipelineStrategy(preset)``, left to find them.
Lightning's launcher starts the second rank by running this same command again. Each rank saves the dense
layer and its table shard before and after four steps to OUT_DIR/<STRATEGY>.rank<R>.pt.
"""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_hstu import HSTUPipelineStrategy
from lightning_hstu.data.toy import ToyDataModule
from lightning_hstu.hstu.sparse import ShardedEmbeddings

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' helpers
from lightning_runs import QUIET, end_rank_script  # noqa: E402


class ShardedTableRecommender(pl.LightningModule):
    """The mean of a history's item embeddings (a row-wise sharded table) and a linear layer."""

    def __init__(self, ignore_shards_itself: bool):
        super().__init__()
        self.head = nn.Linear(16, 1)
        self.embeddings = None
        self.ignore_shards_itself = ignore_shards_itself

    def configure_model(self):
        if self.embeddings is not None:
            return
        table = EmbeddingConfig(name="item", embedding_dim=16, num_embeddings=64, feature_names=["item"])
        self.embeddings = ShardedEmbeddings([table], self.trainer.strategy.root_device)
        if self.ignore_shards_itself:
            states = [*self.named_parameters(), *self.named_buffers()]
            self._ddp_params_and_buffers_to_ignore = [name for name, _ in states if name.startswith("embeddings.")]

    def training_step(self, batch, batch_idx):
        items, ratings = batch
        lengths = torch.full((len(items),), items.shape[1])
        features = KeyedJaggedTensor.from_lengths_sync(keys=["item"], values=items.flatten(), lengths=lengths)
        pooled = self.embeddings(features)["item"].values().view(len(items), -1, 16).mean(1)
        return F.mse_loss(self.head(pooled).squeeze(-1), ratings)

    def configure_optimizers(self):
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


class Shards(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        self.before = {k: v.clone() for k, v in pl_module.embeddings.local_weights().items()}


def main() -> None:
    out_dir, strategy = sys.argv[1], sys.argv[2]
    pl.seed_everything(0, verbose=False)
    model = ShardedTableRecommender(ignore_shards_itself=strategy == "ddp")
    shards = Shards()
    trainer = pl.Trainer(
        strategy=strategy if strategy == "ddp" else HSTUPipelineStrategy(strategy),
        accelerator="cpu",
        devices=2,
        max_steps=4,
        callbacks=[shards],
        **QUIET,
    )
    trainer.fit(model, ToyDataModule())
    torch.save(
        {
            "head": {k: v.clone() for k, v in model.head.state_dict().items()},
            "before": shards.before,
            "after": model.embeddings.local_weights(),
        },
        f"{out_dir}/{strategy}.rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
    end_rank_script()
