"""NVTX ranges around every engine task, opened and closed on the thread that runs it, so that an Nsight
Systems timeline shows the engine as the seed's Gantt does. A no-op when no profiler listens (also on CPU)."""

import nvtx
from lightning.pytorch import Callback

from ..plan import PlanTask
from ._engine import observe_engine

DOMAIN = "lightning-hstu"
THREAD_COLORS = ("blue", "green", "orange", "purple", "red", "cyan", "yellow", "magenta", "brown", "olive")


class NVTXCallback(Callback):
    """``task@b<batch> la<lookahead>`` ranges (the batch index also as the payload), one colour per
    engine thread; with ``step_ranges`` also one ``batch <k>`` range per trained batch on the caller's
    thread (from its on_train_batch_start to its on_train_batch_end)."""

    def __init__(self, step_ranges: bool = False, domain: str = DOMAIN):
        self.step_ranges, self.domain = step_ranges, domain
        self._colors: dict[str, str] = {}

    def setup(self, trainer, pl_module, stage):
        if observe_engine(trainer, self):
            threads = list(trainer.strategy.plan.threads)
            self._colors = {t: THREAD_COLORS[i % len(THREAD_COLORS)] for i, t in enumerate(threads)}

    def task_started(self, task: PlanTask, batch: int, step: int, thread: str) -> None:
        nvtx.push_range(
            message=f"{task.name}@b{batch} la{task.lookahead}",
            color=self._colors.get(thread, "blue"),
            domain=self.domain,
            payload=batch,
        )

    def task_ended(self, task: PlanTask, batch: int, step: int, thread: str) -> None:
        nvtx.pop_range(domain=self.domain)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.step_ranges:
            nvtx.push_range(message=f"batch {batch_idx}", color="gray", domain=self.domain, payload=batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.step_ranges:
            nvtx.pop_range(domain=self.domain)
