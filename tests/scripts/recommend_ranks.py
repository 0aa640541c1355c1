"""Trains the HSTU recommender a few steps on two processes, then predicts every user's next items with a
``RecommendationWriter``; run by test_recommendations.py (two CPU processes, gloo).

    python recommend_ranks.py OUT_DIR USERS

Lightning's launcher starts the second rank by running this same command again. Rank 0 saves the users of
the data and the path of the file written to OUT_DIR/users.pt.
"""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_hstu import HSTUPipelineStrategy
from lightning_hstu.callbacks import RecommendationWriter
from lightning_hstu.models.hstu import HSTURecommender

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' helpers
from lightning_runs import QUIET, end_rank_script  # noqa: E402
from small_hstu import SMALL_MODEL, small_data  # noqa: E402


def main() -> None:
    out_dir, users = sys.argv[1], int(sys.argv[2])
    pl.seed_everything(0, verbose=False)
    model, data = HSTURecommender(**SMALL_MODEL), small_data(num_users=users)
    writer = RecommendationWriter(top_k=4)
    trainer = pl.Trainer(
        strategy=HSTUPipelineStrategy("default_d6"),
        accelerator="cpu",
        devices=2,
        max_steps=2,
        callbacks=[writer],
        **{**QUIET, "logger": pl.loggers.CSVLogger(out_dir)},
    )
    trainer.fit(model, data)
    trainer.predict(model, datamodule=data, return_predictions=False)
    if trainer.is_global_zero:
        histories = {h.user: list(h.items) for h in data.latest}
        torch.save({"histories": histories, "path": str(writer.path)}, f"{out_dir}/users.pt")


if __name__ == "__main__":
    main()
    end_rank_script()
