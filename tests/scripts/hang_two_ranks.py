"""Two gloo ranks of which rank 1 hangs at one precise point; run by test_watchdog_ranks.py.

    python hang_two_ranks.py SCENARIO OUT_DIR STEP_TIMEOUT [ACCELERATOR]

Rank 1 hangs at batch ``HANG_AT``:

- ``task``: stops (SIGSTOP) in the backward task of the HSTU recommender, before TorchRec's all-to-all;
- ``toy_task``: stops in the backward task of the toy recommender, before DDP's gradient all-reduce;
- ``agreement``: stops in its data loader, so that rank 0 waits in the ranks' per-batch agreement;
- ``loader``: its data loader never returns (it keeps running: its own watchdog reports it);
- ``caller``: stops in ``on_train_batch_start``, where every rank all-reduces on the caller's own thread
  (as Lightning's per-batch SIGTERM broadcast does), so that rank 0's caller hangs in that collective.

ACCELERATOR is ``cpu`` (gloo, the default) or ``gpu`` (NCCL). Each rank writes what it prints to
OUT_DIR/rank<R>.log and its pid to OUT_DIR/rank<R>.pid; rank 1 writes the time it hangs (``time.time()``) to
OUT_DIR/hung_at.
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from lightning_hstu import HSTUPipelineStrategy
from lightning_hstu.models.toy import ToyRecommender

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' helpers
from lightning_runs import QUIET  # noqa: E402

HANG_AT = 6
HUNG_RANK = 1


def hang(out_dir: str, how: str) -> None:
    """Rank 1 only: note the time, then stop this whole process (``how == "stop"``), and block this thread for
    good."""
    if dist.get_rank() != HUNG_RANK:
        return
    Path(out_dir, "hung_at").write_text(repr(time.time()))
    if how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    # The stop reaches every thread when it next returns to user mode: this one could otherwise run on, into
    # the collective after this point (seen: the loader's per-batch agreement, which then completed on the
    # other rank, so that it waited in a later collective instead), before the process stops.
    threading.Event().wait()


def until_the_caller_waits_for_the_loader() -> None:
    """The engine's loader thread pulls a batch while the step before it runs: return once this rank's caller
    (the main thread) waits for the loader thread (that step, collectives included, and the hooks between the
    steps have finished)."""
    while True:
        frame = sys._current_frames().get(threading.main_thread().ident)
        while frame is not None:
            if frame.f_code.co_name == "_wait" and frame.f_code.co_filename.endswith("engine.py"):
                return
            frame = frame.f_back
        time.sleep(0.01)


class Batches(IterableDataset):
    """Toy batches, endless; rank 1's loader hangs when asked for batch ``HANG_AT`` if ``how`` says so (to
    stop, it waits until its caller waits for that batch: the other rank then waits in the per-batch
    agreement, not in a collective of the step before)."""

    def __init__(self, out_dir: str, how: str | None):
        self.out_dir, self.how = out_dir, how

    def __iter__(self):
        gen = torch.Generator().manual_seed(dist.get_rank())
        for index in range(10_000):
            if index == HANG_AT and self.how is not None:
                if self.how == "stop" and dist.get_rank() == HUNG_RANK:
                    until_the_caller_waits_for_the_loader()
                hang(self.out_dir, self.how)
            yield torch.randint(0, 64, (8, 6), generator=gen), torch.randn(8, generator=gen)


class AllReducesBeforeEachBatch(ToyRecommender):
    """A collective on the caller's thread before each batch; rank 1 stops just before it at ``HANG_AT``."""

    def __init__(self, out_dir: str):
        super().__init__()
        self.out_dir = out_dir

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == HANG_AT:
            hang(self.out_dir, "stop")
        dist.all_reduce(torch.ones(1, device=self.device))


class StopsInBackward(ToyRecommender):
    def __init__(self, out_dir: str):
        super().__init__()
        self.out_dir = out_dir

    def training_step(self, batch, batch_idx):
        self.training_batch = batch_idx
        return super().training_step(batch, batch_idx)

    def backward(self, loss, *args, **kwargs):
        if self.training_batch == HANG_AT:
            hang(self.out_dir, "stop")
        super().backward(loss, *args, **kwargs)


def hstu_stopping_in_backward(out_dir: str):
    from small_hstu import SMALL_MODEL

    from lightning_hstu.models.hstu import HSTURecommender

    class StopsInBackward(HSTURecommender):
        def training_step(self, batch, batch_idx):
            self.training_batch = batch_idx
            return super().training_step(batch, batch_idx)

        def backward(self, loss, *args, **kwargs):
            if self.training_batch == HANG_AT:
                hang(out_dir, "stop")
            super().backward(loss, *args, **kwargs)

    return StopsInBackward(**SMALL_MODEL)


def main(scenario: str, out_dir: str, step_timeout: float, accelerator: str = "cpu") -> None:
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # set by Lightning's launcher for the rank it starts
    log = open(Path(out_dir, f"rank{rank}.log"), "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    Path(out_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy=HSTUPipelineStrategy("default_d6", step_timeout=step_timeout),
        accelerator=accelerator,
        devices=2,
        max_steps=40,
        **QUIET,
        limit_val_batches=0,
        use_distributed_sampler=scenario == "task",
    )
    if scenario == "task":
        from small_hstu import small_data

        trainer.fit(hstu_stopping_in_backward(out_dir), small_data(num_users=512))
        return
    how = {"agreement": "stop", "loader": "wait"}.get(scenario)
    model = {"caller": AllReducesBeforeEachBatch, "toy_task": StopsInBackward}.get(
        scenario, lambda _: ToyRecommender()
    )(out_dir)
    trainer.fit(model, train_dataloaders=DataLoader(Batches(out_dir, how), batch_size=None))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), *sys.argv[4:5])
