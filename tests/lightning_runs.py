"""Fitting the toy recommender under a strategy, quietly, and comparing runs."""

import os
import sys
import tempfile

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger

from lightning_hstu.data.toy import ToyDataModule
from lightning_hstu.models.toy import ToyRecommender
from lightning_hstu.strategies.process_groups import end_process_groups

QUIET = dict(
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
)

_SCRATCH: list[tempfile.TemporaryDirectory] = []


def _scratch_dir() -> str:
    """Where a fit writes what it is not told to write elsewhere (Lightning's default checkpoint callback saves
    under ``default_root_dir``, the working directory unless given): made at the process's first fit (the
    rank scripts import this module for ``end_rank_script`` alone) and removed at the end of the process."""
    if not _SCRATCH:
        _SCRATCH.append(tempfile.TemporaryDirectory(prefix="lightning-runs-"))
    return tempfile.mkdtemp(dir=_SCRATCH[0].name)


def end_rank_script() -> None:
    """The end of a rank script whose run succeeded: its process groups destroyed (``end_process_groups``), its
    scratch directory removed, its output flushed, and the process ended with exit code 0 at once. Left to the
    interpreter's exit, gloo's threads can abort a process whose run succeeded ("terminate called without an
    active exception", exit code -6), also after its groups were destroyed (docs/reliability.md). The tests
    assert what the ranks computed; a run that failed does not get here (its exception ends the script with 1)."""
    end_process_groups()
    for scratch in _SCRATCH:
        scratch.cleanup()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class SharedDirectoryLogger(Logger):
    """A logger whose directory is shared by every run, as WandbLogger's ``save_dir`` (default ``.``),
    MLFlowLogger's (``./mlruns``) or LitLogger's (``root/name``): Lightning's ``trainer.log_dir`` is then that
    directory, not a ``version_N`` of the run's own."""

    name, version = "shared", 0

    def __init__(self, save_dir):
        super().__init__()
        self._save_dir = str(save_dir)

    @property
    def save_dir(self):
        return self._save_dir

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, *args, **kwargs):
        pass


class RecordingLogger(Logger):
    """A logger that keeps every ``(step, metrics)`` row it is given, in memory."""

    name, version = "recording", 0

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[int | None, dict]] = []

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, *args, **kwargs):
        pass


def fit(
    strategy,
    *,
    model_cls=ToyRecommender,
    model_kwargs=None,
    data_cls=ToyDataModule,
    data_kwargs=None,
    ckpt_path=None,
    weights_only=None,
    **trainer_kwargs,
):
    """Train a fresh model, made after seeding, on ``data_cls(**data_kwargs)`` (the toy data: 12 batches an
    epoch by default); return (model, trainer)."""
    pl.seed_everything(0, verbose=False)
    model = model_cls(**(model_kwargs or {}))
    options = {
        **QUIET,
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 2,
        "use_distributed_sampler": False,
        "default_root_dir": _scratch_dir(),
        **trainer_kwargs,
    }
    trainer = pl.Trainer(strategy=strategy, **options)
    trainer.fit(model, data_cls(**(data_kwargs or {})), ckpt_path=ckpt_path, weights_only=weights_only)
    return model, trainer


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), f"{name} differs by {(sa[name] - sb[name]).abs().max()}"
