"""The ring of batches in flight: ``depth`` entries reused round-robin (batch ``b`` -> entry ``b % depth``)."""

from typing import Any

from ..plan import INPUT_SLOT, PlanTask
from .errors import EngineError, SlotError

SKIPPED = object()
"""Returned by a task body that had nothing to do; its record is marked skipped."""


class RingEntry:
    """The state of one batch in flight: its slots, and the CUDA events of the tasks that ran on it."""

    __slots__ = ("index", "slots", "events")

    def __init__(self, index: int, batch: Any):
        self.index = index
        self.slots: dict[str, Any] = {INPUT_SLOT: batch}
        self.events: dict[str, Any] = {}


class Ring:
    def __init__(self, depth: int):
        self.depth = depth
        self._entries: list[RingEntry | None] = [None] * depth

    def put(self, index: int, batch: Any) -> None:
        old = self._entries[index % self.depth]
        if old is not None:
            # A batch's entry is free once its lookahead-0 tasks are done, i.e. `depth` steps later.
            raise EngineError(f"ring entry of batch {index} still holds batch {old.index}")
        self._entries[index % self.depth] = RingEntry(index, batch)

    def get(self, index: int) -> RingEntry:
        entry = self._entries[index % self.depth]
        if entry is None or entry.index != index:
            # The tag check: an entry (and its events) from another batch can never satisfy a lookup.
            raise EngineError(f"batch {index} is not in the ring")
        return entry

    def entries(self) -> list[RingEntry]:
        """The batches in flight, oldest first."""
        return sorted((e for e in self._entries if e is not None), key=lambda e: e.index)

    def retire(self, index: int) -> None:
        entry = self._entries[index % self.depth]
        if entry is not None and entry.index == index:
            self._entries[index % self.depth] = None


class BatchView:
    """A batch as one task sees it: it reads only the slots it declared, writes only those it writes."""

    __slots__ = ("_entry", "_task", "step")

    def __init__(self, entry: RingEntry, task: PlanTask, step: int):
        self._entry, self._task, self.step = entry, task, step

    @property
    def index(self) -> int:
        """The batch's index in the epoch (0-based)."""
        return self._entry.index

    def __getitem__(self, slot: str) -> Any:
        if slot not in self._task.reads:
            raise SlotError(
                f"task '{self._task.name}' reads slot '{slot}' it did not declare; "
                f"it reads: {', '.join(self._task.reads) or 'nothing'}"
            )
        try:
            return self._entry.slots[slot]
        except KeyError:
            raise SlotError(
                f"task '{self._task.name}' read slot '{slot}' of batch {self.index} before any task wrote it"
            ) from None

    def __setitem__(self, slot: str, value: Any) -> None:
        if slot not in self._task.writes:
            raise SlotError(
                f"task '{self._task.name}' writes slot '{slot}' it did not declare; "
                f"it writes: {', '.join(self._task.writes) or 'nothing'}"
            )
        self._entry.slots[slot] = value
