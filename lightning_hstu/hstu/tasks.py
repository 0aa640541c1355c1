"""The fourteen HSTU tasks as data: the one definition every task list derives from.

A task's edges follow from the slots it reads and writes (``plan/graph.py``); where it runs and how far
ahead come from a preset (``presets.py``); its body comes from whoever runs it: the module's
``hstu_<task>`` method (``models/hstu.py``), or Lightning's own pieces for a plain LightningModule
(``loops/lightning_tasks.py``).
"""

from ..plan import INPUT_SLOT, Stream, TaskDef


def _task(name: str, stream: str, reads=(), writes=(), **kwargs) -> TaskDef:
    return TaskDef(name, Stream(stream), tuple(reads), tuple(writes), **kwargs)


def hstu_tasks(prefetch: bool = True) -> tuple[TaskDef, ...]:
    """The fourteen HSTU tasks in plan order (the data flow, top to bottom).

    With ``prefetch`` the embedding-cache prefetch of the next batch must finish before this step's
    backward, since both touch the cache: a sync edge prefetch_embeddings -> backward.
    """
    backward_syncs = ("prefetch_embeddings",) if prefetch else ()
    return (
        _task("h2d", "memcpy", [INPUT_SLOT], ["device_batch"]),
        _task("start_shuffle", "memcpy", ["device_batch"], ["workloads"], collective=True),
        _task("finish_shuffle", "memcpy", ["device_batch", "workloads"], ["shuffled_batch"], collective=True),
        _task("start_input_dist", "data_dist", ["shuffled_batch"], ["input_dist_splits"], collective=True),
        _task("wait_input_dist", "data_dist", ["input_dist_splits"], ["sparse_input"], collective=True),
        _task("prefetch_embeddings", "prefetch", ["sparse_input"], ["cache_prefetched"]),
        _task("zero_grad", "default", [], ["grads_cleared"], stateful=True),
        _task("global_tokens_allreduce", "default", ["shuffled_batch"], ["global_tokens"], collective=True),
        _task(
            "compute_output_dist",
            "default",
            ["sparse_input", "cache_prefetched"],
            ["embeddings"],
            collective=True,
            stateful=True,
        ),
        _task("forward", "default", ["shuffled_batch", "embeddings", "global_tokens"], ["loss"], stateful=True),
        _task(
            "backward",
            "default",
            ["loss", "grads_cleared"],
            ["grads"],
            syncs_after=backward_syncs,
            collective=True,
            stateful=True,
        ),
        _task("finalize_model_grads", "default", ["grads"], ["reduced_grads"], collective=True, stateful=True),
        _task("optimizer_step", "default", ["reduced_grads"], ["stepped"], stateful=True),
        _task("watchdog", "default", ["loss", "stepped"], [], stateful=True),
    )


HSTU_TASK_NAMES: tuple[str, ...] = tuple(t.name for t in hstu_tasks())
"""The task names in plan order; every other list of HSTU tasks is derived from this one."""

GRAPH_TASKS: tuple[str, ...] = ("forward", "backward", "optimizer_step")
"""The HSTU tasks a plan marks capturable for graph capture: the dense forward replays its graph, the
backward replays the matching backward graph through autograd, and the optimizer step replays its own
(``GraphedAdamW``)."""
