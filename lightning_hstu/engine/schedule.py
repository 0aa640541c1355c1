"""What the engine does for each task, derived once from the plan's edges.

Host waits come from ``Plan.wait_edges``; CUDA event waits from every edge whose two tasks use
different streams (also across steps: the host barrier does not wait for the GPU); tickets from
``Plan.ticket_order``. Nothing here re-derives a dependency rule of its own. A task records a CUDA event
only where one is read: a consumer on another stream waits for it, or the task is a collective (a hung
step's report says whose collective work has not completed).
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..plan import Edge, EdgeKind, Plan, PlanError, PlanTask

Body = Callable[[Any], Any]


@dataclass(frozen=True)
class StreamInput:
    """An edge into a task from a task on another stream: the consumer's stream waits for its event."""

    producer: str
    same_batch: bool
    """Ord edge: the producer worked on the consumer's batch. Sync edge: on its own batch of this step."""
    producer_lookahead: int
    slots: tuple[str, ...]
    """Slots to keep alive for the consumer's stream."""


@dataclass(frozen=True)
class ScheduledTask:
    task: PlanTask
    body: Body | None
    host_waits: tuple[str, ...]
    """Producers on other threads that must finish this step's run first (the plan's wait edges)."""
    stream_inputs: tuple[StreamInput, ...]
    records_event: bool
    """Whether the task records an event on its stream after its body: a task on another stream consumes
    its results (``stream_inputs``), or it is a collective."""


def schedule(plan: Plan, bodies: Mapping[str, Body | None]) -> dict[str, tuple[ScheduledTask, ...]]:
    """Thread name -> its tasks in run order, each with its body and derived waits."""
    _check_bodies(plan, bodies)
    waited_on = {e.producer for e in plan.edges if _crosses_streams(plan, e)}
    scheduled = {
        t.name: _schedule_task(plan, t, bodies[t.name], t.name in waited_on or t.collective) for t in plan.tasks
    }
    return {thread: tuple(scheduled[n] for n in names) for thread, names in plan.threads.items()}


def _crosses_streams(plan: Plan, edge: Edge) -> bool:
    return plan.task(edge.producer).stream != plan.task(edge.consumer).stream


def _schedule_task(plan: Plan, task: PlanTask, body: Body | None, records_event: bool) -> ScheduledTask:
    host_waits = tuple(p for p, c in plan.sorted_wait_edges() if c == task.name)
    stream_inputs = tuple(
        StreamInput(e.producer, e.kind == EdgeKind.ORD, plan.task(e.producer).lookahead, e.slots)
        for e in plan.edges
        if e.consumer == task.name and _crosses_streams(plan, e)
    )
    return ScheduledTask(task, body, host_waits, stream_inputs, records_event)


def _check_bodies(plan: Plan, bodies: Mapping[str, Body | None]) -> None:
    names = [t.name for t in plan.tasks]
    unknown = [n for n in bodies if n not in names]
    if unknown:
        raise PlanError(
            f"bodies name unknown task{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}; tasks are: {', '.join(names)}"
        )
    missing = [n for n in names if n not in bodies]
    if missing:
        raise PlanError(
            f"no body for task{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}"
            f" (give None for a task that has nothing to do)"
        )
    for name, body in bodies.items():
        if body is not None and not callable(body):
            raise PlanError(f"body of task '{name}' must be callable or None, got {type(body).__name__}")
