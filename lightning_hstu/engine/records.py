"""What the engine measured: one record per task run, and summaries of them."""

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple


class TaskRecord(NamedTuple):
    """One run of one task on one batch. Times are ``time.perf_counter()`` seconds on the host.
    (A named tuple: one is made per task per step, on the hot path.)"""

    task: str
    batch: int
    step: int
    thread: str
    start: float
    """When the body started (after all waits)."""
    end: float
    wait: float
    """Seconds spent waiting for other threads (wait edges and the collective ticket) before ``start``."""
    skipped: bool = False
    """The task had nothing to do for this batch (no body, or the body returned ``SKIPPED``)."""
    waited_on: tuple[str, ...] = ()
    """Producers on other threads this run actually blocked on (wait edges, or the ticket holder)."""

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class StepResult:
    """One finished step: all threads passed its barrier."""

    step: int
    batch: int | None
    """The batch whose lookahead-0 tasks ran in this step (None during the fill)."""
    records: tuple[TaskRecord, ...]


@dataclass(frozen=True)
class TaskSummary:
    task: str
    thread: str
    count: int
    skipped: int
    mean_ms: float
    p50_ms: float
    p99_ms: float
    wait_ms: float
    """Mean time per run spent waiting on other threads."""


def summarize(records: Iterable[TaskRecord], task_order: Iterable[str]) -> list[TaskSummary]:
    by_task: dict[str, list[TaskRecord]] = {name: [] for name in task_order}
    for r in records:
        by_task.setdefault(r.task, []).append(r)
    return [_summary(name, runs) for name, runs in by_task.items() if runs]


def _summary(task: str, runs: list[TaskRecord]) -> TaskSummary:
    ms = sorted(r.duration * 1e3 for r in runs)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return TaskSummary(
        task,
        runs[0].thread,
        len(runs),
        sum(r.skipped for r in runs),
        statistics.fmean(ms),
        statistics.median(ms),
        p99,
        statistics.fmean(r.wait * 1e3 for r in runs),
    )


def format_summary(summaries: list[TaskSummary]) -> str:
    header = (
        f"{'task':<24} {'thread':<14} {'runs':>5} {'skip':>5} {'mean ms':>8} {'p50 ms':>8} {'p99 ms':>8} {'wait ms':>8}"
    )
    rows = [
        f"{s.task:<24} {s.thread:<14} {s.count:>5} {s.skipped:>5} {s.mean_ms:>8.3f} {s.p50_ms:>8.3f} "
        f"{s.p99_ms:>8.3f} {s.wait_ms:>8.3f}"
        for s in summaries
    ]
    return "\n".join([header, "-" * len(header), *rows])
