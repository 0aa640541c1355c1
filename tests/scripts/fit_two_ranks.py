"""Fits the toy recommender on two processes, once per STRATEGY, one after the other in the same processes;
run by test_strategy_ranks.py (two CPU processes, gloo) and test_two_gpus.py.

    python fit_two_ranks.py OUT_DIR STRATEGY [STRATEGY ...] [--data {even,uneven,uneven_sized}]
        [--accelerator {cpu,gpu}]
        [--pin-threads CORE,CORE]

Lightning's launcher starts the second rank by running this same command again (with ``--accelerator gpu``
rank R trains on CUDA device R, over NCCL). After each fit every rank saves its weights, the batches it
trained, its global step and the warnings about untrained batches to OUT_DIR/<STRATEGY>.rank<R>.pt. With
``--pin-threads`` an ``hstu_<preset>`` strategy is ``HSTUPipelineStrategy(preset, pin_threads=[...])``, and
each training step's cores are saved too.
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
from lightning_runs import QUIET, end_process_groups  # noqa: E402


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


def fit(strategy: str, out_dir: str, data: str, accelerator: str, pin_threads: list[int] | None) -> None:
    pl.seed_everything(0, verbose=False)
    model = ToyRecommender() if pin_threads is None else CoreRecording()
    trainer = pl.Trainer(
        strategy=strategy
        if pin_threads is None
        else HSTUPipelineStrategy(strategy.removeprefix("hstu_"), pin_threads=pin_threads),
        accelerator=accelerator,
        devices=2,
        max_epochs=2,
        **QUIET,
        limit_val_batches=0,
        use_distributed_sampler=data == "even",  # the uneven loaders are each rank's own
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if data == "uneven":
            trainer.fit(model, train_dataloaders=DataLoader(UnevenBatches(), batch_size=None))
        elif data == "uneven_sized":
            trainer.fit(model, train_dataloaders=DataLoader(UnevenSizedBatches(), batch_size=None))
        else:
            trainer.fit(model, ToyDataModule(num_samples=128))
    untrained = [str(w.message) for w in caught if "ran out of training data" in str(w.message)]
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
    args = parser.parse_args()
    for strategy in args.strategies:
        fit(strategy, args.out_dir, args.data, args.accelerator, args.pin_threads)


if __name__ == "__main__":
    main()
    end_process_groups()
