"""Recommendations written to a file: what ``lightning-hstu predict`` leaves behind."""

import csv
import math
import os
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ..paths import unused


class RecommendationWriter(BasePredictionWriter):
    """Writes the recommendations of ``trainer.predict`` (``models.ranking.RankingEvaluation.predict_step``:
    each user's ``top_k`` best next items, the items already in the history left out unless
    ``seen_items``) to ``<log_dir>/<filename>`` (Lightning's ``trainer.log_dir``: a CSV or TensorBoard
    logger's ``version_N``, another logger's ``save_dir``, without a logger ``default_root_dir``), or
    ``<stem>-v1.csv``... where that is taken (never over a file already there), a CSV file with one row per
    user and recommendation: ``user,rank,item,score`` (rank 1 is the best), users in ascending order, with
    the dataset's own user and item ids where the data module renumbered them (``user_ids``/``item_ids``:
    MovieLens's userId and movieId). Every rank's recommendations are gathered to rank 0, which writes the
    file under a hidden name and renames it into place when whole (a write cut short leaves no truncated
    file). Recommendations for no item (score -inf: a user who has seen nearly the whole catalogue) are
    left out. Scores that are not a number (weights or inputs that went non-finite) raise on every rank,
    naming the users, and write no file: ``topk`` ranks NaN above every item, so the file would hold fewer
    or no items for them, silently."""

    def __init__(self, top_k: int = 10, seen_items: bool = False, filename: str = "recommendations.csv"):
        super().__init__(write_interval="batch")
        if top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {top_k}")
        self.top_k, self.seen_items, self.filename = top_k, seen_items, filename
        self.path: Path | None = None
        """The file written by the last predict (None before)."""
        self._rows: list[tuple[int, int, int, float]] = []
        self._not_a_number: list[int] = []
        """Users with a NaN among their best scores, in this predict."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "predict":
            pl_module.predict_top_k, pl_module.predict_seen_items = self.top_k, self.seen_items

    def on_predict_epoch_start(self, trainer, pl_module) -> None:
        self._rows, self._not_a_number = [], []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        for user, items, scores in zip(
            prediction["user"].tolist(), prediction["items"].tolist(), prediction["scores"].tolist()
        ):
            if any(math.isnan(score) for score in scores):
                self._not_a_number.append(user)
            self._rows.extend(
                (user, rank, item, score)
                for rank, (item, score) in enumerate(zip(items, scores), 1)
                if score > -math.inf
            )

    def on_predict_epoch_end(self, trainer, pl_module) -> None:
        log_dir = trainer.log_dir  # on every rank: a broadcast from rank 0
        rows, not_a_number = self._rows, self._not_a_number
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (rows, not_a_number))
            rows = [row for part, _ in gathered for row in part]
            not_a_number = [user for _, part in gathered for user in part]
        self._rows, self._not_a_number = [], []
        if not_a_number:  # on every rank: each has gathered the same users
            users = sorted(not_a_number)
            raise ValueError(
                f"the model scored NaN for {len(users)} users ({', '.join(map(str, users[:5]))}"
                f"{', ...' if len(users) > 5 else ''}; the model's own user ids): its weights or their inputs are "
                f"not finite; no recommendations written"
            )
        if not trainer.is_global_zero:
            return
        path = Path(log_dir or trainer.default_root_dir) / self.filename
        path.parent.mkdir(parents=True, exist_ok=True)
        users, items = (getattr(trainer.datamodule, name, None) for name in ("user_ids", "item_ids"))
        if users is not None or items is not None:
            rows = [
                (user if users is None else users[user], rank, item if items is None else items[item], score)
                for user, rank, item, score in rows
            ]
        # written whole under a hidden name, then renamed: a write cut short (a full disk, a kill) leaves no
        # truncated file under the name a reader takes for finished
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        try:
            with partial.open("w", newline="") as file:
                writer = csv.writer(file)
                writer.writerow(("user", "rank", "item", "score"))
                writer.writerows(sorted(rows))
            # never over a file already there: log_dir is a run's own version_N only under a CSV or
            # TensorBoard logger; under others (Wandb, MLflow, LitLogger) it is their save_dir, which every
            # run shares
            self.path = unused(path)
            os.replace(partial, self.path)
        finally:
            partial.unlink(missing_ok=True)
        users = len({row[0] for row in rows})
        rank_zero_info(f"recommendations for {users} users written to {self.path}")
