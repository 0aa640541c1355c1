"""A plan: every task with its stream, lookahead and thread, plus the waits and tickets derived from them.

A plan is plain data (no threads, no CUDA), printable and checkable on any machine. ``build_plan``
validates every task, lookahead, thread and edge and raises ``PlanError`` naming the culprit.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from .errors import PlanError
from .graph import Edge, EdgeKind, find_cycle, format_cycle, task_edges
from .tasks import Stream, TaskDef

LEGACY_THREAD = "main"
"""The single thread of a plan without a thread map: the caller's own thread."""


@dataclass(frozen=True)
class PlanTask:
    """A task placed by a plan: in step ``k`` it works on batch ``k + lookahead``, on ``thread``."""

    name: str
    stream: Stream
    lookahead: int
    thread: str
    definition: TaskDef
    capturable: bool = False
    """The engine may capture (part of) its body in CUDA graphs, between steps (``Engine(graphs=...)``)."""

    @property
    def collective(self) -> bool:
        return self.definition.collective

    @property
    def reads(self) -> tuple[str, ...]:
        return self.definition.reads

    @property
    def writes(self) -> tuple[str, ...]:
        return self.definition.writes


@dataclass(frozen=True, eq=False)
class Plan:
    name: str
    """The preset's name, or "custom"."""
    cascade: str
    """The name of the cascade of lookaheads it was built from, or "custom" for user lookaheads."""
    tasks: tuple[PlanTask, ...]
    """Every task in plan order; tasks of one thread run in this order within a step."""
    edges: tuple[Edge, ...]
    """All ord and sync edges between tasks (see ``graph.EdgeKind``)."""
    threads: Mapping[str, tuple[str, ...]]
    """Thread name -> its tasks in run order."""
    wait_edges: frozenset[tuple[str, str]]
    """(producer, consumer) pairs whose consumer waits for the producer inside a step (docs/concepts.md)."""
    ticket_order: tuple[str, ...]
    """Collective tasks in the order they launch within every step, identical on every rank."""
    legacy: bool
    """True when every task runs on the caller's thread (no thread map)."""

    @property
    def capturable(self) -> tuple[str, ...]:
        """The tasks whose body the engine may capture in CUDA graphs."""
        return tuple(t.name for t in self.tasks if t.capturable)

    @property
    def depth(self) -> int:
        """Ring size: the number of batches in flight."""
        return max(t.lookahead for t in self.tasks) + 1

    def task(self, name: str) -> PlanTask:
        for t in self.tasks:
            if t.name == name:
                return t
        raise PlanError(f"plan '{self.name}' has no task '{name}'; tasks are: {', '.join(t.name for t in self.tasks)}")

    def describe(self) -> str:
        """Threads with their tasks (``task@lookahead``) and the wait edges, one per line."""
        lines = [
            f"{self.name}: cascade {self.cascade}, depth {self.depth}, "
            f"{len(self.threads)} thread{'s' if len(self.threads) > 1 else ''}"
            f"{' (legacy: the caller runs every task)' if self.legacy else ''}"
        ]
        for thread, names in self.threads.items():
            lines.append(
                f"  {thread}: "
                + " ".join(f"{n}@{self.task(n).lookahead}{'[graph]' * self.task(n).capturable}" for n in names)
            )
        waits = ", ".join(f"{p} -> {c}" for p, c in self.sorted_wait_edges()) or "none"
        lines.append(f"  waits: {waits}")
        lines.append(f"  tickets: {' < '.join(self.ticket_order) or 'none'}")
        return "\n".join(lines)

    def sorted_wait_edges(self) -> list[tuple[str, str]]:
        order = {t.name: i for i, t in enumerate(self.tasks)}
        return sorted(self.wait_edges, key=lambda e: (order[e[1]], order[e[0]]))


def build_plan(
    tasks: Sequence[TaskDef],
    lookahead: Mapping[str, int],
    thread_map: Mapping[str, str] | None,
    *,
    ticket_order: Sequence[str] | None = None,
    name: str = "custom",
    cascade: str = "custom",
    capturable: Sequence[str] = (),
) -> Plan:
    """Place ``tasks`` and derive waits and tickets; raise ``PlanError`` for anything that cannot run.

    ``lookahead`` maps task -> lookahead (tasks not named get 0). ``thread_map`` maps every task to a
    thread name, or is None for the single-threaded legacy order. ``ticket_order`` lists the collective
    tasks in launch order (default: plan order).
    """
    tasks = tuple(tasks)
    edges = task_edges(tasks)
    names = [t.name for t in tasks]
    lookaheads = _resolve_lookahead(tasks, lookahead)
    threads_of = {n: LEGACY_THREAD for n in names} if thread_map is None else _resolve_thread_map(names, thread_map)
    _check_lookahead_order(edges, lookaheads)
    unknown = [n for n in capturable if n not in names]
    if unknown:
        raise PlanError(f"capturable tasks {unknown} are not tasks of the plan; tasks are: {', '.join(names)}")
    placed = tuple(
        PlanTask(t.name, t.stream, lookaheads[t.name], threads_of[t.name], t, t.name in capturable) for t in tasks
    )
    threads: dict[str, tuple[str, ...]] = {}
    for t in placed:
        threads[t.thread] = threads.get(t.thread, ()) + (t.name,)
    waits = frozenset(
        (e.producer, e.consumer)
        for e in edges
        if _in_step(e, lookaheads) and threads_of[e.producer] != threads_of[e.consumer]
    )
    tickets = _resolve_ticket_order(tasks, ticket_order)
    _check_no_deadlock(edges, lookaheads, threads_of, threads, tickets)
    return Plan(name, cascade, placed, edges, MappingProxyType(threads), waits, tickets, legacy=thread_map is None)


def _in_step(edge: Edge, lookaheads: Mapping[str, int]) -> bool:
    """Whether an edge orders two tasks inside one step (else an earlier step already ran the producer)."""
    return edge.kind == EdgeKind.SYNC or lookaheads[edge.producer] == lookaheads[edge.consumer]


def _resolve_lookahead(tasks: tuple[TaskDef, ...], lookahead: Mapping[str, int]) -> dict[str, int]:
    if not isinstance(lookahead, Mapping):
        raise PlanError(f"lookahead must map task -> int, got {type(lookahead).__name__}")
    names = [t.name for t in tasks]
    for name, value in lookahead.items():
        if name not in names:
            raise PlanError(f"lookahead names unknown task '{name}'; tasks are: {', '.join(names)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PlanError(f"lookahead of task '{name}' must be an int >= 0, got {value!r}")
    resolved = {n: lookahead.get(n, 0) for n in names}
    for t in tasks:
        if t.stateful and resolved[t.name] != 0:
            raise PlanError(
                f"task '{t.name}' uses model state that every batch shares, so its lookahead must be 0 "
                f"(got {resolved[t.name]}); lookahead may move only: "
                f"{', '.join(x.name for x in tasks if not x.stateful)}"
            )
    return resolved


def _resolve_thread_map(names: list[str], thread_map: Mapping[str, str]) -> dict[str, str]:
    if not isinstance(thread_map, Mapping):
        raise PlanError(f"thread_map must map task -> thread name, got {type(thread_map).__name__}")
    for task, thread in thread_map.items():
        if task not in names:
            raise PlanError(f"thread_map names unknown task '{task}'; tasks are: {', '.join(names)}")
        if not isinstance(thread, str) or not thread:
            raise PlanError(
                f"thread_map maps task -> thread name, but task '{task}' maps to {thread!r}"
                f"{' (a thread -> tasks mapping is not accepted)' if not isinstance(thread, str) else ''}"
            )
    missing = [n for n in names if n not in thread_map]
    if missing:
        raise PlanError(
            f"thread_map misses task{'s' if len(missing) > 1 else ''} "
            f"{', '.join(repr(m) for m in missing)}: every task needs exactly one thread"
        )
    return dict(thread_map)


def _check_lookahead_order(edges: tuple[Edge, ...], lookaheads: Mapping[str, int]) -> None:
    for e in edges:
        if e.kind == EdgeKind.ORD and lookaheads[e.producer] < lookaheads[e.consumer]:
            raise PlanError(
                f"lookahead puts consumer '{e.consumer}' (lookahead {lookaheads[e.consumer]}) before its "
                f"producer '{e.producer}' (lookahead {lookaheads[e.producer]}): a consumer's lookahead "
                f"must not exceed its producer's"
            )


def _resolve_ticket_order(tasks: tuple[TaskDef, ...], ticket_order: Sequence[str] | None) -> tuple[str, ...]:
    collectives = [t.name for t in tasks if t.collective]
    if ticket_order is None:
        return tuple(collectives)
    if isinstance(ticket_order, str) or not isinstance(ticket_order, Sequence):
        raise PlanError(f"ticket_order must be a sequence of task names, got {ticket_order!r}")
    order = tuple(ticket_order)
    if sorted(order) != sorted(collectives):
        raise PlanError(
            f"ticket_order must list each collective task exactly once: "
            f"{', '.join(collectives)}; got {', '.join(order)}"
        )
    return order


def _check_no_deadlock(edges, lookaheads, threads_of, threads, tickets) -> None:
    """Thread order, in-step waits and tickets together must be acyclic, or some step can never finish."""
    successors: dict[str, list[tuple[str, str]]] = {n: [] for n in threads_of}
    for thread, names in threads.items():
        for a, b in zip(names, names[1:]):
            successors[a].append((b, f"thread {thread}"))
    for e in edges:
        if _in_step(e, lookaheads):
            successors[e.producer].append((e.consumer, f"{e.kind} edge"))
    for a, b in zip(tickets, tickets[1:]):
        successors[a].append((b, "ticket"))
    cycle = find_cycle(successors)
    if cycle is not None:
        kinds = {why.split()[0] for _, why, _ in cycle}
        what = "collective ticket order" if "ticket" in kinds else "task order"
        raise PlanError(f"{what} can deadlock: {format_cycle(cycle)}")
