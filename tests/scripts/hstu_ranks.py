"""Trains the HSTU recommender on two processes under one preset with the collective-order check on; run by
test_hstu_ranks.py (two CPU processes, gloo) and test_two_gpus.py.

    python hstu_ranks.py PRESET[,PRESET...] OUT_DIR STEPS [--mismatch] [--accelerator {cpu,gpu}]

Several presets (comma-separated) train one after the other in the same two processes (one launch: the
interpreters and imports of a launch cost more than a hundred steps of the small model), each from the same
seed; each rank then saves each preset's results to OUT_DIR/<PRESET>.rank<R>.pt, as soon as that preset's
fit ends.

``--mismatch``: rank 1 launches one collective more than rank 0 (on a group of its own, so that nothing
waits for it) in finish_shuffle, which the check must report. With ``--accelerator gpu`` rank R trains on
CUDA device R, over NCCL. Each rank saves its global step, how many steps were compared, the collectives
of each compared step (its inventories) and its dense weights to OUT_DIR/rank<R>.pt (one preset).
"""

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_hstu import HSTUPipelineStrategy
from lightning_hstu.callbacks import CollectiveInventoryCallback
from lightning_hstu.models.hstu import HSTURecommender

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' helpers
from lightning_runs import QUIET, end_rank_script  # noqa: E402
from small_hstu import model_and_data  # noqa: E402


class EveryInventory(CollectiveInventoryCallback):
    """Keeps the inventory of every recorded step (the callback's ``inventory`` is the last one's)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.inventories = []

    def on_train_batch_end(self, *args):
        super().on_train_batch_end(*args)
        if self.inventory and (not self.inventories or self.inventory is not self.inventories[-1]):
            self.inventories.append(self.inventory)


class OneMoreOnRank1(HSTURecommender):
    def configure_model(self) -> None:
        super().configure_model()
        self._solo = dist.new_group([1])  # every rank creates the group; only rank 1 is in it

    def hstu_finish_shuffle(self, b) -> None:
        super().hstu_finish_shuffle(b)
        if dist.get_rank() == 1:
            dist.all_reduce(torch.zeros(1, device=self.device), group=self._solo)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("preset")
    parser.add_argument("out_dir")
    parser.add_argument("steps", type=int)
    parser.add_argument("--mismatch", action="store_true")
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--trace-dir", help="keep the profiler trace of each recorded step there")
    args = parser.parse_args()
    presets = args.preset.split(",")
    for preset in presets:
        name = "rank" if len(presets) == 1 else f"{preset}.rank"
        train(preset, args, f"{args.out_dir}/{name}")


def train(preset: str, args: argparse.Namespace, path: str) -> None:
    """One fit under ``preset``; each rank saves its results to ``path`` + its rank + ".pt"."""
    model_kwargs, data = model_and_data(args.accelerator)
    pl.seed_everything(0, verbose=False)
    model = (OneMoreOnRank1 if args.mismatch else HSTURecommender)(**model_kwargs)
    check = EveryInventory(
        batch=[5, args.steps // 2, args.steps - 1],
        path=None,
        print_table=False,
        compare_ranks=True,
        trace_dir=args.trace_dir,
    )
    trainer = pl.Trainer(
        strategy=HSTUPipelineStrategy(preset),
        accelerator=args.accelerator,
        devices=2,
        max_steps=args.steps,
        **QUIET,
        limit_val_batches=0,
        callbacks=[check],
    )
    trainer.fit(model, data())
    torch.save(
        {
            "global_step": trainer.global_step,
            "compared": check.compared,
            "inventories": [[asdict(c) for c in inventory] for inventory in check.inventories],
            "weights": {k: v.detach().cpu() for k, v in model.objectives.state_dict().items()},
        },
        f"{path}{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
    end_rank_script()
