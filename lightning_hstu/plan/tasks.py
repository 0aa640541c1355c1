"""Task definitions: what a task is, independent of when (lookahead) and where (thread) it runs.

A workload defines its tasks as data, with its own code. Their edges are not listed by hand: an ord edge
exists wherever one task reads a slot another writes (plus explicit ``depends_on``), and a sync edge wherever
a task names a producer in ``syncs_after``. Everything else (waits, tickets, CUDA event waits) is derived
from those edges in one place, ``graph.py``.
"""

from dataclasses import dataclass
from enum import StrEnum

INPUT_SLOT = "batch"
"""The slot the engine fills with the batch it pulls from the data iterator."""


class Stream(StrEnum):
    """The CUDA stream a task's GPU work is issued on."""

    DEFAULT = "default"
    MEMCPY = "memcpy"
    DATA_DIST = "data_dist"
    PREFETCH = "prefetch"


@dataclass(frozen=True)
class TaskDef:
    """One unit of per-batch work, before a plan gives it a lookahead and a thread."""

    name: str
    stream: Stream
    reads: tuple[str, ...] = ()
    """Slots of its batch it reads; each is written by exactly one task (or is ``INPUT_SLOT``)."""
    writes: tuple[str, ...] = ()
    """Slots of its batch it writes."""
    depends_on: tuple[str, ...] = ()
    """Tasks that must finish on the same batch first although no slot connects them."""
    syncs_after: tuple[str, ...] = ()
    """Tasks that must finish first *within every step*, whatever batches the two work on."""
    collective: bool = False
    """Launches collectives on the shared communicator, so it takes a ticket (docs/concepts.md, tickets)."""
    stateful: bool = False
    """Reads or updates model state that every batch shares: it must run at lookahead 0, so that batch
    ``k`` sees the model exactly as batch ``k - 1`` left it."""
