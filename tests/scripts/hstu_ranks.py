"""Trains the HSTU recommender on two CPU processes (gloo) under one preset with the collective-order
check on; run by test_hstu_ranks.py.

    python hstu_ranks.py PRESET OUT_DIR STEPS [--mismatch]

``--mismatch``: rank 1 launches one collective more than rank 0 (on a group of its own, so that nothing
waits for it) in finish_shuffle, which the check must report. Each rank saves its global step, how many
steps were compared and its dense weights to OUT_DIR/rank<R>.pt.
"""

import argparse

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_hstu import HSTUPipelineStrategy
from lightning_hstu.callbacks import CollectiveInventoryCallback
from lightning_hstu.data.histories import SyntheticHistories
from lightning_hstu.models.hstu import HSTURecommender


class OneMoreOnRank1(HSTURecommender):
    def configure_model(self) -> None:
        super().configure_model()
        self._solo = dist.new_group([1])  # every rank creates the group; only rank 1 is in it

    def hstu_finish_shuffle(self, b) -> None:
        super().hstu_finish_shuffle(b)
        if dist.get_rank() == 1:
            dist.all_reduce(torch.zeros(1), group=self._solo)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("preset")
    parser.add_argument("out_dir")
    parser.add_argument("steps", type=int)
    parser.add_argument("--mismatch", action="store_true")
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    model = (OneMoreOnRank1 if args.mismatch else HSTURecommender)(
        embedding_dim=16, num_layers=1, num_heads=2, attention_dim=8, hidden_dim=8, max_seq_len=32, dropout=0.0)
    check = CollectiveInventoryCallback(batch=[5, args.steps // 2, args.steps - 1], path=None, print_table=False,
                                        compare_ranks=True)
    trainer = pl.Trainer(strategy=HSTUPipelineStrategy(args.preset), accelerator="cpu", devices=2,
                         max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[check])
    trainer.fit(model, SyntheticHistories(num_users=96, num_items=200, max_seq_len=32, batch_size=8, negatives=4))
    torch.save({"global_step": trainer.global_step, "compared": check.compared,
                "weights": {k: v.detach().clone() for k, v in model.objectives.state_dict().items()}},
               f"{args.out_dir}/rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
