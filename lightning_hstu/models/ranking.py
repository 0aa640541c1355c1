"""Validation and test of a next-item recommender: the held-out item ranked by the model's scores of every
item (``data.evaluation``), logged as ``<stage>/<ranking>/<metric>``, for example ``val/all/HR@10`` and
``test/unseen/NDCG@10``; and its recommendations (``predict``)."""

import torch
from torchmetrics.aggregation import MeanMetric

from ..data.evaluation import METRICS, NO_TARGET, RANKINGS, held_items, metric_values, target_ranks
from ..data.histories import FILLER_USER
from ..hstu.batch import HSTUBatch

STAGES = ("val", "test")


class RankingEvaluation:
    """Mixin for a LightningModule that defines ``score_items(batch) -> [B, items + 1]`` (the next item's
    score for each history of an evaluation batch, whose ``target`` feature is the held-out item) and
    ``evaluation_weights()`` (the tensors that hold its weights, for ``callbacks.RankingReport``).

    ``predict_step`` recommends each history's ``predict_top_k`` best next items (id 0 is no item; the
    items already in the history only with ``predict_seen_items``): ``trainer.predict`` on
    ``HistoryDataModule.predict_dataloader`` recommends after every user's whole history, and
    ``callbacks.RecommendationWriter`` sets both attributes and writes the recommendations to a file.

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

    predict_top_k: int = 10
    predict_seen_items: bool = False

    def predict_step(self, batch: HSTUBatch, batch_idx: int) -> dict[str, torch.Tensor]:
        """``user`` [R], ``items`` [R, k] (best first) and their ``scores`` [R, k], on the CPU, for the batch's
        histories except fillers (``FILLER_USER``); k is ``predict_top_k``, or fewer where fewer items can be
        recommended (the catalogue, less the user's items unless ``predict_seen_items``: the history's and,
        where the batch has the key, ``earlier``'s, the items before a history cut to ``max_seq_len``; a user
        who has seen more than ``items - k`` items gets scores of -inf at its end, for no item)."""
        if self.predict_top_k < 1:
            raise ValueError(f"predict_top_k must be at least 1, got {self.predict_top_k}")
        with torch.no_grad():
            scores = self.score_items(batch).float()
        scores[:, 0] = -torch.inf  # no item
        if not self.predict_seen_items:
            scores[held_items(scores, *seen_items(batch))] = -torch.inf
        best, items = scores.topk(min(self.predict_top_k, scores.shape[1] - 1), dim=1)
        users = batch.features["user"].values()
        real = users != FILLER_USER
        return {"user": users[real].cpu(), "items": items[real].cpu(), "scores": best[real].cpu()}

    def validation_step(self, batch: HSTUBatch, batch_idx: int) -> None:
        self._log_ranks("val", batch)

    def test_step(self, batch: HSTUBatch, batch_idx: int) -> None:
        self._log_ranks("test", batch)

    def _log_ranks(self, stage: str, batch: HSTUBatch) -> None:
        with torch.no_grad():
            scores = self.score_items(batch)
        targets = batch.features["target"].values()
        counted = (targets != NO_TARGET).float()
        ranks = target_ranks(scores, targets, *seen_items(batch))
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


def seen_items(batch: HSTUBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Every item each sample's user rated before what is predicted, back to back per sample, and their
    counts: the history's (``item``) and, where the batch has the key, ``earlier``'s (the items before a
    history cut to ``max_seq_len``)."""
    window = batch.features["item"]
    if "earlier" not in batch.features.keys():
        return window.values(), window.lengths()
    earlier = batch.features["earlier"]
    samples = torch.arange(len(window.lengths()), device=window.values().device)
    rows = torch.cat(
        [torch.repeat_interleave(samples, window.lengths()), torch.repeat_interleave(samples, earlier.lengths())]
    )
    items = torch.cat([window.values(), earlier.values()])[torch.argsort(rows, stable=True)]
    return items, window.lengths() + earlier.lengths()
