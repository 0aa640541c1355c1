"""Trains the HSTU recommender a few steps on two processes, then predicts each history's five best items on
the first PAIRS validation pairs through Lightning's predict sampler, once per PAIRS given, in that order;
run by test_hstu_ranks.py (two CPU processes, gloo).

    python hstu_predict_ranks.py OUT_DIR PAIRS [PAIRS ...]

Lightning's launcher starts the second rank by running this same command again. Each rank saves its
predictions, or the error ``trainer.predict`` raised, to OUT_DIR/pairs<PAIRS>.rank<R>.pt.
"""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Subset

from lightning_hstu import HSTUPipelineStrategy
from lightning_hstu.models.hstu import HSTURecommender

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' helpers
from lightning_runs import QUIET, end_rank_script  # noqa: E402
from small_hstu import SMALL_MODEL, small_data  # noqa: E402


class Recommending(HSTURecommender):
    def predict_step(self, batch, batch_idx):
        return self.score_items(batch).topk(5).indices


def main() -> None:
    out_dir, counts = sys.argv[1], [int(pairs) for pairs in sys.argv[2:]]
    pl.seed_everything(0, verbose=False)
    model = Recommending(**SMALL_MODEL)
    data = small_data(num_users=96)
    trainer = pl.Trainer(
        strategy=HSTUPipelineStrategy("default_d6"), accelerator="cpu", devices=2, max_steps=2, **QUIET
    )
    trainer.fit(model, data)
    evaluation = data.val_dataloader()
    for pairs in counts:
        loader = DataLoader(Subset(evaluation.dataset, range(pairs)), batch_size=2, collate_fn=evaluation.collate_fn)
        try:
            result = {"predictions": [rows.tolist() for rows in trainer.predict(model, loader)]}
        except RuntimeError as error:
            result = {"error": str(error)}
        torch.save(result, f"{out_dir}/pairs{pairs}.rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
    end_rank_script()
