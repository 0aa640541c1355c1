"""Chrome / Perfetto trace JSON of chosen steps: a track per engine thread, a slice per task run (batch and
lookahead as args), a flow arrow for every wait that occurred, and on a GPU a track per CUDA stream with
each task's GPU work measured by CUDA events. Opens in ui.perfetto.dev and chrome://tracing."""

import json
from pathlib import Path
from time import perf_counter
from typing import NamedTuple

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from ..checks import at_least
from ..engine import TaskRecord
from ..plan import Plan, PlanTask
from ._engine import TaskEvents, observe_engine
from .pictures import draw_gantt


class DeviceSlice(NamedTuple):
    """A task's work on its CUDA stream: from when the stream reached the task's first event (the work
    queued before it done) to when it finished the task's work; ``perf_counter`` seconds, like TaskRecord."""

    task: str
    batch: int
    step: int
    stream: str
    start: float
    end: float


class _ChosenBatches(Callback):
    """Collects the task records of trained batches ``first`` .. ``first + count - 1`` of the fit (counted
    across epochs), including the fill steps before the first batch."""

    def __init__(self, first: int, count: int):
        self.first, self.count = first, count
        self.records: list[TaskRecord] = []
        self._seen = 0

    def on_fit_start(self, trainer, pl_module):
        self.records, self._seen = [], 0  # a second fit of the Trainer: its own batches, not the first fit's

    def _warn_unreached(self, what: str) -> None:
        if not self.records:
            rank_zero_warn(
                f"{type(self).__name__}: fit trained {self._seen} batches, the {what} starts at batch "
                f"{self.first}: nothing written (choose an earlier batch)"
            )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.first <= self._seen < self.first + self.count:
            self.records.extend(getattr(trainer.strategy, "step_records", ()))
        self._seen += 1


class TraceCallback(_ChosenBatches):
    """Writes the trace of the steps that trained batches ``first_batch`` .. ``+ num_batches - 1``.

    ``stream_tracks``: on a CUDA device, also a track per CUDA stream. Each task's GPU work is bracketed
    by CUDA events on its stream; to place them on the host's clock the callback synchronises the device
    once, when the traced steps begin (a trace is a diagnosis, not a production setting)."""

    def __init__(
        self, path: str = "engine_trace.json", first_batch: int = 10, num_batches: int = 3, stream_tracks: bool = True
    ):
        at_least(0, first_batch=first_batch)
        at_least(1, num_batches=num_batches)
        super().__init__(first_batch, num_batches)
        self.path = Path(path)
        self.stream_tracks = stream_tracks
        self.device_slices: list[DeviceSlice] = []
        self._anchor = None  # (CUDA event, perf_counter) taken together on an idle device
        self._events = TaskEvents()

    def on_fit_start(self, trainer, pl_module):
        super().on_fit_start(trainer, pl_module)
        self.device_slices, self._anchor, self._events = [], None, TaskEvents()

    def setup(self, trainer, pl_module, stage):
        if self.stream_tracks and trainer.strategy.root_device.type == "cuda":
            observe_engine(trainer, self)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._seen == self.first and self.stream_tracks and trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # idle: the anchor event completes at once
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._anchor = (event, perf_counter())

    def task_started(self, task: PlanTask, batch: int, step: int, thread: str) -> None:
        if self._tracing():
            self._events.start(task, batch)

    def task_ended(self, task: PlanTask, batch: int, step: int, thread: str) -> None:
        self._events.end(task, batch, step)

    def _tracing(self) -> bool:
        return self._anchor is not None and self._seen < self.first + self.count

    @rank_zero_only
    def on_fit_end(self, trainer, pl_module):
        if self._events.done:
            torch.cuda.synchronize()
            anchor, at = self._anchor
            clock = lambda event: at + anchor.elapsed_time(event) / 1e3  # noqa: E731  (ms after the anchor)
            self.device_slices = [
                DeviceSlice(r.task.name, r.batch, r.step, str(r.task.stream), clock(r.start), clock(r.end))
                for r in self._events.done
            ]
        if self.records:
            write_trace(trainer.strategy.plan, self.records, self.path, self.device_slices)
        self._warn_unreached("trace")


class GanttCallback(_ChosenBatches):
    """Draws the Gantt of the steps that trained the chosen batch(es): ``<path>.png`` and ``.svg``."""

    def __init__(self, path: str = "engine_gantt", batch: int = 10, num_batches: int = 1):
        at_least(0, batch=batch)
        at_least(1, num_batches=num_batches)
        super().__init__(batch, num_batches)
        self.path = path

    @rank_zero_only
    def on_fit_end(self, trainer, pl_module):
        if self.records:
            draw_gantt(trainer.strategy.plan, self.records, self.path)
        self._warn_unreached("Gantt")


def write_trace(plan: Plan, records: list[TaskRecord], path: Path, device_slices: list[DeviceSlice] = ()) -> dict:
    threads = list(plan.threads)
    origin = min([r.start - r.wait for r in records] + [d.start for d in device_slices])
    us = lambda t: round((t - origin) * 1e6, 3)  # noqa: E731
    events = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": f"lightning-hstu engine ({plan.name})"}}]
    events += [
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": i, "args": {"name": t}} for i, t in enumerate(threads)
    ]
    ends = {}
    for r in records:
        task = plan.task(r.task)
        events.append(
            {
                "ph": "X",
                "pid": 0,
                "tid": threads.index(r.thread),
                "name": r.task,
                "cat": str(task.stream),
                "ts": us(r.start),
                "dur": max(us(r.end) - us(r.start), 0.001),
                "args": {
                    "batch": r.batch,
                    "step": r.step,
                    "lookahead": task.lookahead,
                    "stream": str(task.stream),
                    "skipped": r.skipped,
                    "wait_us": round(r.wait * 1e6, 3),
                },
            }
        )
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
    if device_slices:
        streams = sorted({d.stream for d in device_slices})
        events.append({"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "CUDA streams (task events)"}})
        events += [
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": i, "args": {"name": f"stream {s}"}}
            for i, s in enumerate(streams)
        ]
        for d in device_slices:
            events.append(
                {
                    "ph": "X",
                    "pid": 1,
                    "tid": streams.index(d.stream),
                    "name": d.task,
                    "cat": d.stream,
                    "ts": us(d.start),
                    "dur": max(us(d.end) - us(d.start), 0.001),
                    "args": {"batch": d.batch, "step": d.step, "stream": d.stream},
                }
            )
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace))
    return trace
