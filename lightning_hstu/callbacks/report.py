"""Prints the model's leave-last-out ranking metrics beside the most-popular baseline when fit ends."""

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_only


class RankingReport(Callback):
    """Needs a datamodule with ``baseline(k)`` (``data.histories.HistoryDataModule``) and a model that logs
    ``val/HR@10`` and ``val/NDCG@10``."""

    def on_fit_end(self, trainer, pl_module):
        self._print(trainer)

    @rank_zero_only
    def _print(self, trainer) -> None:
        metrics = trainer.callback_metrics
        if "val/HR@10" not in metrics:
            return
        hr, ndcg = trainer.datamodule.baseline(10)
        print("\nleave-last-out, ranked among all items:")
        print(f"  HSTU          HR@10 {float(metrics['val/HR@10']):.4f}   NDCG@10 {float(metrics['val/NDCG@10']):.4f}")
        print(f"  most popular  HR@10 {hr:.4f}   NDCG@10 {ndcg:.4f}")
