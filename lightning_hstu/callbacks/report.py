"""The ranking report: the test metrics of the best validation epoch's weights, beside the most-popular
baseline and other models' runs on the same data."""

import json
import math
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from ..data.evaluation import METRICS, RANKINGS

RESULTS_FILE = "ranking.json"
UNFITTED = "the module's weights as given: no fit ran with this report and no checkpoint was loaded"


class RankingReport(Callback):
    """Keeps the weights of the best validation epoch (by ``monitor``, higher is better) in memory and puts
    them back when fit ends, so that a ``trainer.test`` after fit (``lightning-hstu fit`` runs one) scores
    the test items once, with those weights. After the test it prints every metric under both rankings for
    this model, for each other model whose ``ranking.json`` lies in a sibling run directory with the same
    split (the same users' held-out items: the latest run per model, with its histories' length where that
    differs from this run's), and for the most-popular baseline; and writes this run's
    ``ranking.json`` into its log directory (a CSV or TensorBoard logger's ``version_N``; without a logger, or
    under another, whose directory every run shares, there is none: nothing is written and no other run is
    read). The report names the weights it tested: the best epoch's where ``on_fit_end`` put them
    back, a checkpoint's (``trainer.test(ckpt_path=...)``), those at the end of fit, with the best epoch
    they are not (a fit that raised; a resumed fit whose best epoch came before the resume and stayed best:
    the checkpoint carries the best score and epoch, not their weights), or, with neither a fit nor a
    checkpoint (``lightning-hstu test`` without ``--ckpt_path``), the module's weights as given; that last
    run writes no ``ranking.json``, so other runs' reports do not show it as this model's.

    Needs a model with ``evaluation_weights()`` that logs ``val/...`` and ``test/...`` as
    ``models.ranking.RankingEvaluation`` does, and a datamodule with ``most_popular()``, ``description`` and
    ``split`` (``data.histories.HistoryDataModule``)."""

    def __init__(self, monitor: str = "val/all/NDCG@10", name: str | None = None):
        self.monitor, self.name = monitor, name
        self.best_score: float | None = None
        self.best_epoch: int | None = None
        self._best: list[torch.Tensor] | None = None
        self._restored: int | None = None  # the epoch whose weights on_fit_end put back, since fit started
        self._fitted = False  # a fit ran with this report: the weights are a fit's

    def state_dict(self) -> dict:
        return {"best_score": self.best_score, "best_epoch": self.best_epoch}

    def load_state_dict(self, state: dict) -> None:
        # the best so far, whose weights are not in memory: a later epoch must beat it to be put back
        self.best_score, self.best_epoch, self._best = state["best_score"], state["best_epoch"], None

    def on_fit_start(self, trainer, pl_module) -> None:
        self._restored = None
        self._fitted = True

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        if self.monitor not in trainer.callback_metrics:
            logged = ", ".join(k for k in trainer.callback_metrics if k.startswith("val/")) or "none"
            raise KeyError(f"RankingReport monitors {self.monitor!r}, which validation did not log; logged: {logged}")
        score = float(trainer.callback_metrics[self.monitor])
        score = -math.inf if math.isnan(score) else score  # a NaN epoch never stays the best
        if self.best_score is None or score > self.best_score:
            self.best_score, self.best_epoch = score, trainer.current_epoch
            self._best = [w.detach().clone() for w in pl_module.evaluation_weights()]

    def on_fit_end(self, trainer, pl_module) -> None:
        if self._best is None:
            return
        with torch.no_grad():
            for live, best in zip(pl_module.evaluation_weights(), self._best):
                live.copy_(best)
        self._restored = self.best_epoch

    def on_test_end(self, trainer, pl_module) -> None:
        # on every rank: Lightning's log_dir is a broadcast from rank 0, which only rank 0 would join below
        log_dir = trainer.log_dir if trainer.loggers else None  # no logger, no run directory (log_dir: the cwd)
        if trainer.loggers and not isinstance(trainer.loggers[0], (CSVLogger, TensorBoardLogger)):
            log_dir = None  # log_dir is then the logger's save_dir (Wandb: "."), which every run shares
        self._report(trainer, pl_module, log_dir)

    def tested(self, trainer) -> str:
        """The weights the test ran with, in words."""
        if trainer.ckpt_path:
            return f"weights of checkpoint {trainer.ckpt_path}"
        if self._restored is not None:
            return f"weights of epoch {self._restored}, best {self.monitor} {self.best_score:.4f}"
        if not self._fitted:
            return UNFITTED
        if self.best_epoch is not None:
            return (
                f"weights at the end of fit, not those of the best epoch {self.best_epoch} ({self.monitor} "
                f"{self.best_score:.4f}), which were not put back"
            )
        return "weights at the end of fit"

    @rank_zero_only
    def _report(self, trainer, pl_module, log_dir: str | None) -> None:
        metrics = {
            ranking: {m: float(trainer.callback_metrics[f"test/{ranking}/{m}"]) for m in METRICS}
            for ranking in RANKINGS
            if f"test/{ranking}/{METRICS[0]}" in trainer.callback_metrics
        }
        if not metrics:
            return
        data = trainer.datamodule
        share = _test_share(trainer)
        description = data.description + share
        split = getattr(data, "split", data.description) + share
        name = self.name or _model_name(pl_module)
        weights = self.tested(trainer)
        run_dir = Path(log_dir) if log_dir else None
        result = {
            "model": name,
            "data": description,
            "split": split,
            "max_seq_len": getattr(data, "max_seq_len", None),
            "metrics": metrics,
            "best_epoch": self.best_epoch,
            "weights": weights,
            "monitor": self.monitor,
            "best_score": self.best_score,
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
            "run": str(run_dir) if run_dir else None,
        }
        others = _other_runs(run_dir, split, description, name) if run_dir else []
        rows = [
            (name, metrics, ""),
            *((o["model"], o["metrics"], _other_note(o, description)) for o in others),
            ("most popular", data.most_popular("test"), ""),
        ]
        print(format_report(description, rows, weights))
        if run_dir is not None and weights != UNFITTED:  # not a run of the model: other reports must not show it
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / RESULTS_FILE).write_text(json.dumps(result, indent=2))


def format_report(description: str, rows, weights: str) -> str:
    """The test metrics of each (name, {ranking: {metric: value}}, note) row, one block per ranking;
    ``weights`` says which were tested."""
    lines = [f"\ntest ({description}; the last item of each history, {weights}):"]
    width = max(len(r[0]) for r in rows) + 2
    for ranking, label in RANKINGS.items():
        lines.append(f"{label}:")
        lines.append(" " * (width + 2) + "".join(f"{m:>9}" for m in METRICS))
        for name, metrics, note in rows:
            if ranking in metrics:
                lines.append(f"  {name:<{width}}" + "".join(f"{metrics[ranking][m]:9.4f}" for m in METRICS) + note)
    return "\n".join(lines)


def _test_share(trainer) -> str:
    """'' where the test ran over every batch of its loader, else which share it ran over (``limit_test_batches``,
    ``fast_dev_run``): the means of a share are not those of all test users, so the description that the
    report matches runs by says so."""
    loaders, ran = trainer.test_dataloaders, trainer.num_test_batches
    loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
    if not ran or len(loaders) != len(ran) or not all(hasattr(loader, "__len__") for loader in loaders):
        return ""
    batches = [len(loader) for loader in loaders]
    if all(done >= total for done, total in zip(ran, batches)):
        return ""
    return f"; tested on {sum(min(d, t) for d, t in zip(ran, batches))} of {sum(batches)} test batches"


def _model_name(pl_module) -> str:
    return type(pl_module).__name__.removesuffix("Recommender") or type(pl_module).__name__


def _other_note(result: dict, description: str) -> str:
    """Where another run's row comes from, and how long its histories were where they differ from this run's."""
    window = result.get("max_seq_len")
    length = f"; histories of at most {window} events" if window and result.get("data") != description else ""
    return f"  ({result['run']}, {result['finished']}{length})"


def _other_runs(run_dir: Path, split: str, description: str, name: str) -> list[dict]:
    """The latest result per other model in the sibling run directories, on the same split (runs that read
    histories of other lengths included); a result written without its split, on the same description."""
    latest: dict[str, dict] = {}
    for path in sorted(run_dir.parent.glob(f"*/{RESULTS_FILE}"), key=lambda p: p.stat().st_mtime):
        try:
            result = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        same = result["split"] == split if "split" in result else result.get("data") == description
        if same and result.get("model") != name and path.parent != run_dir:
            latest[result["model"]] = result
    return list(latest.values())
