"""Validates a recommender of fixed scores on two processes (Lightning's DDP, gloo on the CPU); run by
test_evaluation.py.

    python validate_two_ranks.py OUT_FILE

Lightning's launcher starts the second rank by running this same command again. Rank 0 saves the logged
validation metrics to OUT_FILE.
"""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_hstu.data.histories import SyntheticHistories
from lightning_hstu.models.ranking import RankingEvaluation

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' helpers
from lightning_runs import QUIET, end_rank_script  # noqa: E402

DATA = dict(num_users=11, num_items=30, max_seq_len=20, batch_size=2, seed=3)


def fixed_scores(users: torch.Tensor, num_items: int) -> torch.Tensor:
    """Each user's scores of items 0 .. num_items, a function of the user id alone."""
    items = torch.arange(num_items + 1, dtype=torch.float64)
    return torch.sin(users[:, None].double() * 7.3 + items[None, :] * 1.7)


class FixedScores(RankingEvaluation, pl.LightningModule):
    def __init__(self, num_items: int):
        super().__init__()
        self.num_items = num_items
        self.unused = torch.nn.Parameter(torch.zeros(1))

    def score_items(self, batch):
        return fixed_scores(batch.features["user"].values(), self.num_items)


def main() -> None:
    data = SyntheticHistories(**DATA)
    data.setup()
    trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=2, **QUIET)
    trainer.validate(FixedScores(data.num_items), data, verbose=False)
    if trainer.global_rank == 0:
        torch.save({k: float(v) for k, v in trainer.callback_metrics.items()}, sys.argv[1])


if __name__ == "__main__":
    main()
    end_rank_script()
