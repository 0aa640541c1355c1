"""Validation and test of a next-item recommender: the held-out item ranked by the model's scores of every
item (``data.evaluation``), logged as ``<stage>/<ranking>/<metric>``, for example ``val/all/HR@10`` and
``test/unseen/NDCG@10``."""

import torch

from ..data.evaluation import RANKINGS, metric_values, target_ranks
from ..hstu.batch import HSTUBatch


class RankingEvaluation:
    """Mixin for a LightningModule that defines ``score_items(batch) -> [B, items + 1]`` (the next item's
    score for each history of an evaluation batch, whose ``target`` feature is the held-out item) and
    ``evaluation_weights()`` (the tensors that hold its weights, for ``callbacks.RankingReport``)."""

    def validation_step(self, batch: HSTUBatch, batch_idx: int) -> None:
        self._log_ranks("val", batch)

    def test_step(self, batch: HSTUBatch, batch_idx: int) -> None:
        self._log_ranks("test", batch)

    def _log_ranks(self, stage: str, batch: HSTUBatch) -> None:
        with torch.no_grad():
            scores = self.score_items(batch)
        history = batch.features["item"]
        ranks = target_ranks(scores, batch.features["target"].values(), history.values(), history.lengths())
        for ranking in RANKINGS:
            for name, values in metric_values(ranks[ranking]).items():
                self.log(
                    f"{stage}/{ranking}/{name}",
                    values.mean(),
                    batch_size=len(values),
                    sync_dist=True,
                    prog_bar=stage == "val" and ranking == "all" and name == "HR@10",
                )
