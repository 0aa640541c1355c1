"""Chrome / Perfetto trace JSON of chosen steps: a track per engine thread, a slice per task run (batch and
lookahead as args), a flow arrow for every wait that occurred. Opens in ui.perfetto.dev and chrome://tracing."""

import json
from pathlib import Path

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_only

from ..engine import TaskRecord
from ..plan import Plan
from .pictures import draw_gantt


class _ChosenBatches(Callback):
    """Collects the task records of trained batches ``first`` .. ``first + count - 1`` of the fit (counted
    across epochs), including the fill steps before the first batch."""

    def __init__(self, first: int, count: int):
        self.first, self.count = first, count
        self.records: list[TaskRecord] = []
        self._seen = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.first <= self._seen < self.first + self.count:
            self.records.extend(getattr(trainer.strategy, "step_records", ()))
        self._seen += 1


class TraceCallback(_ChosenBatches):
    def __init__(self, path: str = "engine_trace.json", first_batch: int = 10, num_batches: int = 3):
        super().__init__(first_batch, num_batches)
        self.path = Path(path)

    @rank_zero_only
    def on_fit_end(self, trainer, pl_module):
        if self.records:
            write_trace(trainer.strategy.plan, self.records, self.path)


class GanttCallback(_ChosenBatches):
    """Draws the Gantt of the steps that trained the chosen batch(es): ``<path>.png`` and ``.svg``."""

    def __init__(self, path: str = "engine_gantt", batch: int = 10, num_batches: int = 1):
        super().__init__(batch, num_batches)
        self.path = path

    @rank_zero_only
    def on_fit_end(self, trainer, pl_module):
        if self.records:
            draw_gantt(trainer.strategy.plan, self.records, self.path)


def write_trace(plan: Plan, records: list[TaskRecord], path: Path) -> dict:
    threads = list(plan.threads)
    origin = min(r.start - r.wait for r in records)
    us = lambda t: round((t - origin) * 1e6, 3)  # noqa: E731
    events = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": f"lightning-hstu engine ({plan.name})"}}]
    events += [{"ph": "M", "name": "thread_name", "pid": 0, "tid": i, "args": {"name": t}} for i, t in enumerate(threads)]
    ends = {}
    for r in records:
        task = plan.task(r.task)
        events.append({"ph": "X", "pid": 0, "tid": threads.index(r.thread), "name": r.task, "cat": str(task.stream),
                       "ts": us(r.start), "dur": max(us(r.end) - us(r.start), 0.001),
                       "args": {"batch": r.batch, "step": r.step, "lookahead": task.lookahead,
                                "stream": str(task.stream), "skipped": r.skipped, "wait_us": round(r.wait * 1e6, 3)}})
        ends[(r.task, r.step)] = r
    flow = 0
    for r in records:
        for producer in r.waited_on:
            source = ends.get((producer, r.step))
            if source is None:
                continue
            flow += 1
            common = {"pid": 0, "name": f"{producer} -> {r.task}", "cat": "wait", "id": flow}
            events.append({**common, "ph": "s", "tid": threads.index(source.thread), "ts": us(source.end)})
            events.append({**common, "ph": "f", "bp": "e", "tid": threads.index(r.thread), "ts": us(r.start)})
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace))
    return trace
