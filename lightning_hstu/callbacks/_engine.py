"""How callbacks reach the engine."""

from collections import deque
from typing import NamedTuple

import torch

from ..plan import PlanTask


def observe_engine(trainer, observer) -> bool:
    """Have the engine call ``observer`` around every task (see ``engine.TaskObserver``); False when the
    trainer's strategy has no engine (the callback then does nothing)."""
    observers = getattr(trainer.strategy, "engine_observers", None)
    if observers is None:
        return False
    if observer not in observers:
        observers.append(observer)
    return True


class BracketedTask(NamedTuple):
    task: PlanTask
    batch: int
    step: int
    start: torch.cuda.Event
    end: torch.cuda.Event


class TaskEvents:
    """Timing CUDA events around task bodies, recorded on each task's own stream (observers run inside
    it): ``start`` from ``task_started``, ``end`` from ``task_ended``; ``done`` holds the bracketed tasks
    in the order they ended."""

    def __init__(self):
        self.done: deque[BracketedTask] = deque()
        self._open: dict[tuple[str, int], torch.cuda.Event] = {}

    def start(self, task: PlanTask, batch: int) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._open[(task.name, batch)] = event

    def end(self, task: PlanTask, batch: int, step: int) -> None:
        start = self._open.pop((task.name, batch), None)
        if start is None:  # the task started before the bracketing did
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.done.append(BracketedTask(task, batch, step, start, end))
