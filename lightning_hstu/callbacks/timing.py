"""Per-task timing from the engine's task records, logged through the Trainer's loggers and printed as a
table when fit ends; on a GPU, optionally the device time of each task from CUDA events on its stream."""

import statistics
from collections import deque

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_only

from ..checks import at_least
from ..engine import TaskRecord, format_summary, summarize
from ..plan import PlanTask
from ._engine import TaskEvents, observe_engine


class TaskTimingCallback(Callback):
    """Collects the task records of the fit (the strategy's ``step_records``), the last ``max_records``
    of them (the table describes those).

    ``log_every_n_steps``: log mean host ms and wait ms per task (``timing/<task>/host_ms``) that often;
    0 logs nothing. ``print_table``: print count, skipped, mean / p50 / p99 host ms and mean wait per task
    at the end of fit (rank 0). ``device_time``: on a CUDA device, also time each task's GPU work with
    CUDA events recorded on its stream (the elapsed time between the events around its body: the work
    it queued, plus whatever its stream still had to finish), read once the events have completed, never
    waiting for them before the fit ends.
    """

    def __init__(
        self,
        log_every_n_steps: int = 50,
        print_table: bool = True,
        device_time: bool = False,
        max_records: int = 200_000,
    ):
        at_least(0, log_every_n_steps=log_every_n_steps)
        at_least(1, max_records=max_records)
        self.log_every_n_steps, self.print_table, self.device_time = log_every_n_steps, print_table, device_time
        self.max_records = max_records
        self.records: deque[TaskRecord] = deque(maxlen=max_records)
        self._window: list[TaskRecord] = []
        self._logged_step: int | None = None  # the global step logged last
        self._events = TaskEvents()
        self.device_ms: dict[str, deque[float]] = {}
        """Task -> device milliseconds of its last runs (``device_time`` on a CUDA device)."""

    def on_fit_start(self, trainer, pl_module):
        # a second fit of the Trainer: its own table, not both fits' (as FitSummary counts each fit)
        self.records.clear()
        self._window, self._logged_step = [], None
        self.device_ms.clear()

    def setup(self, trainer, pl_module, stage):
        if self.device_time and trainer.strategy.root_device.type == "cuda":
            observe_engine(trainer, self)

    def task_started(self, task: PlanTask, batch: int, step: int, thread: str) -> None:
        self._events.start(task, batch)

    def task_ended(self, task: PlanTask, batch: int, step: int, thread: str) -> None:
        self._events.end(task, batch, step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._read_device_times(wait=False)
        records = list(getattr(trainer.strategy, "step_records", ()))
        self.records.extend(records)
        if self.log_every_n_steps:  # the window is emptied only where it is logged
            self._window.extend(records)
        step = trainer.global_step  # under accumulate_grad_batches several batches end at one step: log it once
        if self.log_every_n_steps and step % self.log_every_n_steps == 0 and step != self._logged_step and self._window:
            self._logged_step = step
            metrics = {}
            for s in summarize(self._window, _task_order(trainer)):
                metrics[f"timing/{s.task}/host_ms"] = s.mean_ms
                metrics[f"timing/{s.task}/wait_ms"] = s.wait_ms
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
            self._window = []

    def on_fit_end(self, trainer, pl_module):
        self._read_device_times(wait=True)
        if self.print_table and self.records:
            self._print(trainer)

    def _read_device_times(self, wait: bool) -> None:
        """Turn completed event pairs into milliseconds, oldest first (events complete in order per stream;
        a pair not done yet stops the scan until the next batch)."""
        done = self._events.done
        if wait and done:
            torch.cuda.synchronize()
        while done and (wait or done[0].end.query()):
            run = done.popleft()
            self.device_ms.setdefault(run.task.name, deque(maxlen=self.max_records)).append(
                run.start.elapsed_time(run.end)
            )

    @rank_zero_only
    def _print(self, trainer) -> None:
        print(f"\nper-task host timing ({trainer.strategy.plan.name}, {len(self.records)} task runs):")
        print(format_summary(summarize(self.records, _task_order(trainer))))
        if self.device_ms:
            print("\nper-task device time (CUDA events on the task's stream):")
            print(f"{'task':<24} {'runs':>5} {'mean ms':>8} {'p50 ms':>8}")
            for task in _task_order(trainer):
                if task in self.device_ms:
                    ms = self.device_ms[task]
                    print(f"{task:<24} {len(ms):>5} {statistics.fmean(ms):>8.3f} {statistics.median(ms):>8.3f}")


def _task_order(trainer) -> list[str]:
    return [t.name for t in trainer.strategy.plan.tasks]
