"""Two gloo ranks train the toy recommender briefly under the engine; at the end of training each asks the
epoch loop's per-batch SIGTERM check, with each combination of the ranks' "received SIGTERM"; run by
test_strategy_ranks.py.

    python sigterm_two_ranks.py OUT_DIR

Each rank saves, per combination (rank 0's flag, rank 1's flag), whether the check that asked the ranks and
the check after it raised Lightning's ``SIGTERMException`` on it, to OUT_DIR/rank<R>.pt.
"""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_hstu import HSTUPipelineStrategy
from lightning_hstu.data.toy import ToyDataModule
from lightning_hstu.models.toy import ToyRecommender

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' helpers
from lightning_runs import QUIET, end_rank_script  # noqa: E402


class AskEachCombination(pl.Callback):
    """At the end of training (the strategy's groups still up), runs the epoch loop's SIGTERM check twice per
    combination of the two ranks' flags: the first check asks the ranks about the flags, the second reads
    the answer (with both flags cleared)."""

    def __init__(self):
        self.raised = {}
        self.raised_when_asked = {}

    def on_train_end(self, trainer, pl_module):
        rank, loop, notice = trainer.global_rank, trainer.fit_loop.epoch_loop, trainer.strategy.sigterm
        for flags in ((False, False), (False, True), (True, False), (True, True)):
            notice.received = flags[rank]
            trainer._signal_connector.received_sigterm = False
            self.raised_when_asked[flags] = _raises(loop)
            notice.received = False
            trainer._signal_connector.received_sigterm = False
            self.raised[flags] = _raises(loop)
            trainer._signal_connector.received_sigterm = False  # set on every rank by a stop
            notice.settle(trainer.strategy.ask_any_rank)  # the second check's own question (no SIGTERM), answered
        notice.received = False
        trainer._signal_connector.received_sigterm = False


def _raises(loop) -> bool:
    try:
        loop._broadcast_sigterm_tensor()
    except SIGTERMException:
        return True
    return False


def main(out_dir: str) -> None:
    pl.seed_everything(0, verbose=False)
    asked = AskEachCombination()
    trainer = pl.Trainer(
        strategy=HSTUPipelineStrategy("default_d6"),
        accelerator="cpu",
        devices=2,
        max_steps=3,
        **QUIET,
        limit_val_batches=0,
        callbacks=[asked],
    )
    trainer.fit(ToyRecommender(), ToyDataModule(num_samples=128))
    saved = {"raised": asked.raised, "raised_when_asked": asked.raised_when_asked}
    torch.save(saved, f"{out_dir}/rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
    end_rank_script()
