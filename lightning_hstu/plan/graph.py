"""The one dependency graph of a plan, from which every kind of wait is derived.

``task_edges`` is the single source of dependencies: the wait rule, the CUDA event waits and the
deadlock check all read its output, so that no two of them can disagree about an order.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from .errors import PlanError
from .tasks import INPUT_SLOT, TaskDef


class EdgeKind(StrEnum):
    """How two tasks are ordered (docs/concepts.md, the wait rule)."""

    ORD = "ord"
    """Same batch: the producer wrote a slot the consumer reads, or the consumer ``depends_on`` it."""
    SYNC = "sync"
    """Same step: the producer runs first in every step, whatever batches the two work on."""


@dataclass(frozen=True)
class Edge:
    producer: str
    consumer: str
    kind: EdgeKind
    slots: tuple[str, ...] = ()
    """The slots that carry data along an ord edge (empty for ``depends_on`` and sync edges)."""

    def __str__(self) -> str:
        return f"{self.producer} -> {self.consumer}"


def task_edges(tasks: tuple[TaskDef, ...]) -> tuple[Edge, ...]:
    """All ord and sync edges of a task set, after checking that every name and slot resolves."""
    names = [t.name for t in tasks]
    _check_unique(names)
    writer = _slot_writers(tasks)
    edges: list[Edge] = []
    for task in tasks:
        slots_by_producer: dict[str, list[str]] = {}
        for slot in task.reads:
            if slot == INPUT_SLOT:
                continue
            if slot not in writer:
                raise PlanError(
                    f"task '{task.name}' reads slot '{slot}' that no task writes; "
                    f"written slots: {sorted(writer)} (and '{INPUT_SLOT}', filled by the engine)"
                )
            slots_by_producer.setdefault(writer[slot], []).append(slot)
        for name in task.depends_on:
            _check_known(name, names, f"depends_on of task '{task.name}'")
            slots_by_producer.setdefault(name, [])
        for producer, slots in slots_by_producer.items():
            edges.append(Edge(producer, task.name, EdgeKind.ORD, tuple(slots)))
        for name in task.syncs_after:
            _check_known(name, names, f"syncs_after of task '{task.name}'")
            edges.append(Edge(name, task.name, EdgeKind.SYNC))
    for edge in edges:
        if edge.producer == edge.consumer:
            raise PlanError(f"task '{edge.producer}' depends on itself")
    return tuple(edges)


def find_cycle(successors: Mapping[str, Iterable[tuple[str, str]]]) -> list[tuple[str, str, str]] | None:
    """A cycle in a graph given as ``node -> [(successor, why), ...]``, or None.

    Returns the cycle as ``[(node, why, next_node), ...]`` so that an error can name every link.
    """
    done: set[str] = set()
    for root in successors:
        if root in done:
            continue
        # Iterative depth-first search; `links[i]` joins `stack[i]` to `stack[i + 1]`.
        stack = [(root, iter(successors[root]))]
        on_stack = {root: 0}
        links: list[tuple[str, str, str]] = []
        while stack:
            node, pending = stack[-1]
            for succ, why in pending:
                if succ in on_stack:
                    return links[on_stack[succ] :] + [(node, why, succ)]
                if succ not in done:
                    on_stack[succ] = len(stack)
                    links.append((node, why, succ))
                    stack.append((succ, iter(successors.get(succ, ()))))
                    break
            else:
                stack.pop()
                del on_stack[node]
                done.add(node)
                if links:
                    links.pop()
    return None


def format_cycle(cycle: list[tuple[str, str, str]]) -> str:
    text = cycle[0][0]
    for _, why, succ in cycle:
        text += f" -[{why}]-> {succ}"
    return text


def _slot_writers(tasks: tuple[TaskDef, ...]) -> dict[str, str]:
    writer: dict[str, str] = {}
    for task in tasks:
        for slot in task.writes:
            if slot == INPUT_SLOT:
                raise PlanError(f"task '{task.name}' writes '{INPUT_SLOT}', the slot the engine fills")
            if slot in writer:
                raise PlanError(f"slot '{slot}' is written by both '{writer[slot]}' and '{task.name}'")
            writer[slot] = task.name
    return writer


def _check_unique(names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if not isinstance(name, str) or not name:
            raise PlanError(f"task names must be non-empty strings, got {name!r}")
        if name in seen:
            raise PlanError(f"task '{name}' is defined twice")
        seen.add(name)


def _check_known(name: str, names: list[str], where: str) -> None:
    if name not in names:
        raise PlanError(f"{where} names unknown task '{name}'; tasks are: {', '.join(names)}")
