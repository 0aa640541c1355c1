"""Task definitions: what a task is, independent of when (lookahead) and where (thread) it runs.

The fourteen HSTU tasks of SPEC §2 are defined here as data. Their edges are not listed by hand: an
ord edge exists wherever one task reads a slot another writes (plus explicit ``depends_on``), and a
sync edge wherever a task names a producer in ``syncs_after``. Everything else (waits, tickets, CUDA
event waits) is derived from those edges in one place, ``graph.py``.
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
    """Launches collectives on the shared communicator, so it takes a ticket (SPEC §5)."""
    stateful: bool = False
    """Reads or updates model state that every batch shares: it must run at lookahead 0, so that batch
    ``k`` sees the model exactly as batch ``k - 1`` left it."""


def _task(name, stream, reads=(), writes=(), **kwargs) -> TaskDef:
    return TaskDef(name, Stream(stream), tuple(reads), tuple(writes), **kwargs)


GRAPH_TASKS: tuple[str, ...] = ("forward", "backward")
"""The HSTU tasks a plan marks capturable for graph capture: the dense forward replays its graph, and the
backward replays the matching backward graph through autograd."""


def hstu_tasks(prefetch: bool = True) -> tuple[TaskDef, ...]:
    """The fourteen HSTU tasks in plan order (the data flow of SPEC §2, top to bottom).

    With ``prefetch`` the embedding-cache prefetch of the next batch must finish before this step's
    backward, since both touch the cache: a sync edge prefetch_embeddings -> backward.
    """
    backward_syncs = ("prefetch_embeddings",) if prefetch else ()
    return (
        _task("h2d", "memcpy", [INPUT_SLOT], ["device_batch"]),
        _task("start_shuffle", "memcpy", ["device_batch"], ["workloads"], collective=True),
        _task("finish_shuffle", "memcpy", ["device_batch", "workloads"], ["shuffled_batch"],
              collective=True),
        _task("start_input_dist", "data_dist", ["shuffled_batch"], ["input_dist_splits"],
              collective=True),
        _task("wait_input_dist", "data_dist", ["input_dist_splits"], ["sparse_input"],
              collective=True),
        _task("prefetch_embeddings", "prefetch", ["sparse_input"], ["cache_prefetched"]),
        _task("zero_grad", "default", [], ["grads_cleared"], stateful=True),
        _task("global_tokens_allreduce", "default", ["shuffled_batch"], ["global_tokens"],
              collective=True),
        _task("compute_output_dist", "default", ["sparse_input", "cache_prefetched"], ["embeddings"],
              collective=True, stateful=True),
        _task("forward", "default", ["shuffled_batch", "embeddings", "global_tokens"], ["loss"],
              stateful=True),
        _task("backward", "default", ["loss", "grads_cleared"], ["grads"],
              syncs_after=backward_syncs, collective=True, stateful=True),
        _task("finalize_model_grads", "default", ["grads"], ["reduced_grads"], collective=True,
              stateful=True),
        _task("optimizer_step", "default", ["reduced_grads"], ["stepped"], stateful=True),
        _task("watchdog", "default", ["loss", "stepped"], [], stateful=True),
    )


HSTU_TASK_NAMES: tuple[str, ...] = tuple(t.name for t in hstu_tasks())
