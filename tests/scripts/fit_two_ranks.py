"""Fits the toy recommender on two processes, once per STRATEGY, one after the other in the same processes;
run by test_strategy_ranks.py (two CPU processes, gloo) and test_two_gpus.py.

    python fit_two_ranks.py OUT_DIR STRATEGY [STRATEGY ...] [--data {even,uneven,uneven_sized}]
        [--accelerator {cpu,gpu}]
        [--pin-threads CORE,CORE] [--validate]

Lightning's launcher starts the second rank by running this same command again (with ``--accelerator gpu``
rank R trains on CUDA device R, over NCCL). After each fit every rank saves its weights, the batches it
trained, its global step and the warnings about untrained batches to OUT_DIR/<STRATEGY>.rank<R>.pt. With
``--pin-threads`` an ``hstu_<preset>`` strategy is ``HSTUPipelineStrategy(preset, pin_threads=[...])``, and
each training step's cores are saved too. With ``--validate`` the fits validate twice an epoch
(``val_check_interval=0.5``; every 3 batches for ``uneven``), and each rank saves the global steps at which
it validated.
"""

import argparse
import os
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_hstu import HSTUPipelineStrategy  # (importing lightning_hstu registers the hstu_* strategies)
from lightning_hstu.data.toy import ToyDataModule
from lightning_hstu.models.toy import ToyRecommender

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' helpers
from lightning_runs import QUIET, end_rank_script  # noqa: E402


class UnevenBatches(IterableDataset):
    """Rank 0 has 10 batches an epoch, rank 1 has 6."""

    def __iter__(self):
        rank = torch.distributed.get_rank()
        gen = torch.Generator().manual_seed(rank)
        for _ in range(10 if rank == 0 else 6):
            yield torch.randint(0, 64, (8, 6), generator=gen), torch.randn(8, generator=gen)


class UnevenSizedBatches(Dataset):
    """A loader with a length: rank 0 has 6 batches an epoch, rank 1 has 10 (the longer rank is not rank 0)."""

    def __len__(self):
        return 6 if torch.distributed.get_rank() == 0 else 10

    def __getitem__(self, index):
        gen = torch.Generator().manual_seed(1000 * torch.distributed.get_rank() + index)
        return torch.randint(0, 64, (8, 6), generator=gen), torch.randn(8, generator=gen)


class CoreRecording(ToyRecommender):
    """Also records the cores of the thread running each training step."""

    def __init__(self):
        super().__init__()
        self.step_cores: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.step_cores.append(sorted(os.sched_getaffinity(0)))
        return super().training_step(batch, batch_idx)


class ValidationSteps(pl.Callback):
    def __init__(self):
        self.steps: list[int] = []

    def on_validation_start(self, trainer, pl_module):
        self.steps.append(trainer.global_step)


def fit(
    strategy: str, out_dir: str, data: str, accelerator: str, pin_threads: list[int] | None, validate: bool
) -> None:
    pl.seed_everything(0, verbose=False)
    model = ToyRecommender() if pin_threads is None else CoreRecording()
    validated = ValidationSteps()
    interval = 3 if data == "uneven" else 0.5  # a loader without a length takes a number of batches
    validation = {"val_check_interval": interval, "limit_val_batches": 2} if validate else {"limit_val_batches": 0}
    trainer = pl.Trainer(
        strategy=strategy
        if pin_threads is None
        else HSTUPipelineStrategy(strategy.removeprefix("hstu_"), pin_threads=pin_threads),
        accelerator=accelerator,
        devices=2,
        max_epochs=2,
        **QUIET,
        **validation,
        callbacks=[validated],
        use_distributed_sampler=data == "even",  # the uneven loaders are each rank's own
    )
    val = ToyDataModule(num_samples=128).val_dataloader() if validate else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if data == "uneven":
            trainer.fit(model, DataLoader(UnevenBatches(), batch_size=None), val)
        elif data == "uneven_sized":
            trainer.fit(model, DataLoader(UnevenSizedBatches(), batch_size=None), val)
        else:
            trainer.fit(model, ToyDataModule(num_samples=128))
    untrained = [str(w.message) for w in caught if "not trained this epoch" in str(w.message)]
    weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    groups = len(dist.distributed_c10d._world.pg_map)  # the process groups left after fit
    torch.save(
        {
            "weights": weights,
            "seen": model.batches_seen,
            "global_step": trainer.global_step,
            "groups": groups,
            "step_cores": getattr(model, "step_cores", None),
            "untrained_warnings": untrained,
            "validated_at": validated.steps,
        },
        f"{out_dir}/{strategy}.rank{trainer.global_rank}.pt",
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("strategies", nargs="+")
    parser.add_argument("--data", choices=("even", "uneven", "uneven_sized"), default="even")
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--pin-threads", type=lambda cores: [int(core) for core in cores.split(",")])
    parser.add_argument("--validate", action="store_true")
    args = parser.parse_args()
    for strategy in args.strategies:
        fit(strategy, args.out_dir, args.data, args.accelerator, args.pin_threads, args.validate)


if __name__ == "__main__":
    main()
    end_rank_script()
