"""Fits the HSTU recommender for one epoch on two processes with the ranking report, then tests it, as
``lightning-hstu fit`` does; run by test_ranking_report.py (two CPU processes, gloo).

    python report_two_ranks.py OUT_DIR

Lightning's launcher starts the second rank by running this same command again. Rank 0 prints the report
and writes ranking.json into the CSV logger's run directory under OUT_DIR.
"""

import sys
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger

from lightning_hstu import HSTUPipelineStrategy
from lightning_hstu.callbacks import RankingReport
from lightning_hstu.models.hstu import HSTURecommender

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' helpers
from lightning_runs import QUIET, end_rank_script  # noqa: E402
from small_hstu import SMALL_MODEL, small_data  # noqa: E402


def main() -> None:
    pl.seed_everything(0, verbose=False)
    model, data = HSTURecommender(**SMALL_MODEL), small_data(num_users=95)
    options = {**QUIET, "logger": CSVLogger(sys.argv[1], name="runs")}
    trainer = pl.Trainer(
        strategy=HSTUPipelineStrategy("default_d6"),
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        callbacks=[RankingReport()],
        **options,
    )
    trainer.fit(model, data)
    trainer.test(model, data, verbose=False)


if __name__ == "__main__":
    main()
    end_rank_script()
