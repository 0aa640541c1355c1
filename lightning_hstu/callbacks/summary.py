"""One line at the end of fit: how many samples were trained, how fast, and the wall time."""

import time

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.data import extract_batch_size


class FitSummary(Callback):
    """Prints ``trained N samples in E epochs: X samples/s; fit T s`` when fit ends, and the wall time
    since the callback was made (about the start of the command: configuration, data, model building and
    fit) after the test when one follows. Samples are this rank's training samples times the world size, less
    the batches a module's ``on_nonfinite_loss="skip"`` dropped (its ``skipped_batches``: no rank applied them)."""

    def __init__(self):
        self.created = time.perf_counter()
        self._start: float | None = None
        self.samples = 0
        self._first_epoch = 0
        self._sizes: dict[int, int] = {}  # batch index -> global samples, this epoch's (skips name an index)
        self._skips_seen = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self._start = time.perf_counter()
        self.samples = 0  # this fit's (a second fit of the Trainer counts, and is timed, on its own)
        self._first_epoch = trainer.current_epoch  # a resumed fit starts at its checkpoint's
        self._sizes = {}
        self._skips_seen = len(getattr(pl_module, "skipped_batches", ()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch is not None:  # a batch the loader gave as None trained nothing
            self._sizes[batch_idx] = _batch_size(batch) * trainer.world_size
            self.samples += self._sizes[batch_idx]
        self._uncount_skipped(pl_module)  # the engine's watchdog task notes a skip before this hook

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._uncount_skipped(pl_module)  # Lightning's own loop notes a skip in the module's batch-end hook
        self._sizes = {}

    def _uncount_skipped(self, pl_module) -> None:
        """Take out the samples of the batches skipped since the last call: a skip is agreed by every rank
        before backward, so every rank dropped that batch."""
        skipped = getattr(pl_module, "skipped_batches", ())
        for _, index in skipped[self._skips_seen :]:  # (epoch, batch): this epoch's, as ``_sizes``
            self.samples -= self._sizes.pop(index, 0)
        self._skips_seen = len(skipped)

    @rank_zero_only
    def on_fit_end(self, trainer, pl_module) -> None:
        if self._start is None:
            return
        self._uncount_skipped(pl_module)  # a fit stopped inside an epoch
        seconds = time.perf_counter() - self._start
        print(
            f"\ntrained {self.samples:,} samples in {self._epochs(trainer)} epochs: "
            f"{self.samples / seconds:,.0f} samples/s; fit {seconds:.1f} s (validation included), "
            f"{time.perf_counter() - self.created:.1f} s since start"
        )

    def _epochs(self, trainer) -> str:
        """Epochs trained, with the fraction of the last one where fit stopped inside it (``max_steps``):
        Lightning counts that epoch as ended."""
        epochs = trainer.current_epoch - self._first_epoch
        last = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # of the last epoch
        per_epoch = trainer.num_training_batches  # the last epoch's (a reload may change it)
        if epochs < 1 or per_epoch in (0, float("inf")) or not 0 < last < per_epoch:
            return f"{epochs}"
        return f"{round(epochs - 1 + last / per_epoch, 2):g}"

    @rank_zero_only
    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "test":  # after every callback's on_test_end (the progress bar's last line included)
            parts = "start-up, fit, test" if self._start is not None else "start-up, test"
            print(f"wall time {time.perf_counter() - self.created:.1f} s ({parts})")


def _batch_size(batch) -> int:
    """An ``HSTUBatch``'s ``size``; else the first tensor's length, as Lightning's own logging takes it (the
    length of a tuple of tensors is how many tensors it holds)."""
    size = getattr(batch, "size", None)
    return size if isinstance(size, int) else extract_batch_size(batch)
