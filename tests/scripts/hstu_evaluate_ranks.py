"""Trains the HSTU recommender a few steps on two processes, then validates and tests it there; run by
test_hstu_ranks.py (two CPU processes, gloo).

    python hstu_evaluate_ranks.py OUT_DIR

Lightning's launcher starts the second rank by running this same command again. Each rank saves its table
shards after fit and after validate and test, and the metrics both logged, to OUT_DIR/rank<R>.pt.
"""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_hstu import HSTUPipelineStrategy
from lightning_hstu.models.hstu import HSTURecommender

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' helpers
from lightning_runs import QUIET, end_rank_script  # noqa: E402
from small_hstu import SMALL_MODEL, small_data  # noqa: E402


def shards(model: HSTURecommender) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.embeddings.local_weights().items()}


def main() -> None:
    pl.seed_everything(0, verbose=False)
    model = HSTURecommender(**SMALL_MODEL)
    data = small_data(num_users=95)  # an odd number of users: one rank's share is filled up
    trainer = pl.Trainer(
        strategy=HSTUPipelineStrategy("default_d6"),
        accelerator="cpu",
        devices=2,
        max_steps=6,
        **{**QUIET, "limit_val_batches": 1.0},
    )
    trainer.fit(model, data)  # 6 steps of a 12-batch epoch: no validation during fit
    after_fit = shards(model)
    validated = {k: float(v) for k, v in trainer.validate(model, data, verbose=False)[0].items()}
    tested = {k: float(v) for k, v in trainer.test(model, data, verbose=False)[0].items()}
    torch.save(
        {
            "after_fit": after_fit,
            "after_evaluation": shards(model),
            "validated": validated,
            "tested": tested,
            "users": len(data.validation),
        },
        f"{sys.argv[1]}/rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
    end_rank_script()
