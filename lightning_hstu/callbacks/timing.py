"""Per-task timing from the engine's task records, logged through the Trainer's loggers and printed as a
table when fit ends."""

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_only

from ..engine import TaskRecord, format_summary, summarize


class TaskTimingCallback(Callback):
    """Collects every task record of the fit (the strategy's ``step_records``).

    ``log_every_n_steps``: log mean host ms and wait ms per task (``timing/<task>/host_ms``) that often;
    0 logs nothing. ``print_table``: print count, skipped, mean / p50 / p99 host ms and mean wait per task
    at the end of fit (rank 0).
    """

    def __init__(self, log_every_n_steps: int = 50, print_table: bool = True):
        self.log_every_n_steps, self.print_table = log_every_n_steps, print_table
        self.records: list[TaskRecord] = []
        self._window: list[TaskRecord] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        records = list(getattr(trainer.strategy, "step_records", ()))
        self.records.extend(records)
        self._window.extend(records)
        if self.log_every_n_steps and trainer.global_step % self.log_every_n_steps == 0 and self._window:
            metrics = {}
            for s in summarize(self._window, _task_order(trainer)):
                metrics[f"timing/{s.task}/host_ms"] = s.mean_ms
                metrics[f"timing/{s.task}/wait_ms"] = s.wait_ms
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
            self._window = []

    def on_fit_end(self, trainer, pl_module):
        if self.print_table and self.records:
            self._print(trainer)

    @rank_zero_only
    def _print(self, trainer) -> None:
        print(f"\nper-task host timing ({trainer.strategy.plan.name}, {len(self.records)} task runs):")
        print(format_summary(summarize(self.records, _task_order(trainer))))


def _task_order(trainer) -> list[str]:
    return [t.name for t in trainer.strategy.plan.tasks]
