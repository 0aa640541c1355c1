"""Validation and test of a next-item recommender: the held-out item ranked by the model's scores of every
item (``data.evaluation``), logged as ``<stage>/<ranking>/<metric>``, for example ``val/all/HR@10`` and
``test/unseen/NDCG@10``."""

import torch
from torchmetrics.aggregation import MeanMetric

from ..data.evaluation import METRICS, NO_TARGET, RANKINGS, metric_values, target_ranks
from ..hstu.batch import HSTUBatch

STAGES = ("val", "test")


class RankingEvaluation:
    """Mixin for a LightningModule that defines ``score_items(batch) -> [B, items + 1]`` (the next item's
    score for each history of an evaluation batch, whose ``target`` feature is the held-out item) and
    ``evaluation_weights()`` (the tensors that hold its weights, for ``callbacks.RankingReport``).

    Each metric is a mean over the stage's samples, kept by a ``torchmetrics`` ``MeanMetric`` (its sums add
    up exactly over ranks, whatever each rank's count); filler samples (target ``NO_TARGET``, which fill up
    the shorter ranks' shares, ``data.histories.EvaluationShares``) count in none."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # made here, not in the first validation step, which runs under inference mode: metric states made
        # there could not be reset outside it
        self.ranking_means = torch.nn.ModuleDict(
            {_key(s, r, m): MeanMetric(nan_strategy="error") for s in STAGES for r in RANKINGS for m in METRICS}
        )

    def validation_step(self, batch: HSTUBatch, batch_idx: int) -> None:
        self._log_ranks("val", batch)

    def test_step(self, batch: HSTUBatch, batch_idx: int) -> None:
        self._log_ranks("test", batch)

    def _log_ranks(self, stage: str, batch: HSTUBatch) -> None:
        with torch.no_grad():
            scores = self.score_items(batch)
        history = batch.features["item"]
        targets = batch.features["target"].values()
        counted = (targets != NO_TARGET).float()
        ranks = target_ranks(scores, targets, history.values(), history.lengths())
        for ranking in RANKINGS:
            for name, values in metric_values(ranks[ranking]).items():
                key = _key(stage, ranking, name)
                mean = self.ranking_means[key]
                mean.update(values, counted)
                self.log(
                    f"{stage}/{ranking}/{name}",
                    mean,
                    on_step=False,
                    on_epoch=True,
                    metric_attribute=f"ranking_means.{key}",
                    prog_bar=stage == "val" and ranking == "all" and name == "HR@10",
                )


def _key(stage: str, ranking: str, metric: str) -> str:
    return f"{stage}_{ranking}_{metric.replace('@', '_at_')}"
