"""The d3 and d6 cascades, the six thread maps and the nine named presets, and the one function
that turns a preset plus a user's changes into a plan (``resolve_plan``: the strategy and the CLI)."""

from collections.abc import Mapping, Sequence

from ..plan import Plan, PlanError, build_plan
from .tasks import HSTU_TASK_NAMES, hstu_tasks

CASCADES: Mapping[str, Mapping[str, int]] = {
    # Tasks not named run at lookahead 0 (this step's batch).
    "d3": {
        "h2d": 2,
        "start_shuffle": 2,
        "finish_shuffle": 2,
        "start_input_dist": 1,
        "wait_input_dist": 1,
        "prefetch_embeddings": 1,
    },
    "d6": {
        "h2d": 5,
        "start_shuffle": 4,
        "finish_shuffle": 3,
        "start_input_dist": 3,
        "wait_input_dist": 2,
        "prefetch_embeddings": 1,
    },
}

_IO = ("h2d", "start_shuffle", "finish_shuffle")
_DATA_DIST = ("start_input_dist", "wait_input_dist")
_PREFETCH = ("prefetch_embeddings",)


def _split(*groups: tuple[str, tuple[str, ...]]) -> dict[str, str]:
    """Thread map from named groups of tasks; every task not in a group runs on "compute"."""
    placed = {task: thread for thread, tasks in groups for task in tasks}
    return {task: placed.get(task, "compute") for task in HSTU_TASK_NAMES}


THREAD_MAPS: Mapping[str, Mapping[str, str]] = {
    "default": _split(("io", _IO)),
    "by_stream": {t.name: str(t.stream) for t in hstu_tasks()},
    "per_task": {name: name for name in HSTU_TASK_NAMES},
    "io_prefetch_compute": _split(("io", _IO), ("prefetch", _PREFETCH)),
    "io_data_dist_compute": _split(("io", _IO), ("data_dist", _DATA_DIST)),
    "full_split": _split(("io", _IO), ("data_dist", _DATA_DIST), ("prefetch", _PREFETCH)),
}

NO_THREAD_MAP = "none"
"""The name that, where a thread map is asked for by name, means none: every task on the caller's thread
(the legacy order of ``legacy_none``)."""

PRESETS: Mapping[str, tuple[str, str | None]] = {
    # preset name: (cascade, thread map; None = every task on the caller's thread)
    "legacy_none": ("d3", None),
    "default_d3": ("d3", "default"),
    "by_stream_d3": ("d3", "by_stream"),
    "per_task_d3": ("d3", "per_task"),
    "io_prefetch_compute_d3": ("d3", "io_prefetch_compute"),
    "io_data_dist_compute_d3": ("d3", "io_data_dist_compute"),
    "full_split_d3": ("d3", "full_split"),
    "default_d6": ("d6", "default"),
    "full_split_d6": ("d6", "full_split"),
}

PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)

PRESET_NOTES: Mapping[str, str] = {
    # Where each preset wins and loses, measured (BENCHMARKS.md, "The user's path"): "light" is the light
    # workload on one H200 through Trainer(strategy=HSTUPipelineStrategy(preset)), ms/step against
    # legacy_none in the same run (2026-11-30; 2026-12-01); "2 GPUs" drives the engine directly on two H200
    # with the balanced shuffler (2026-11-30). Run-to-run noise on those machines is about +-20%.
    "legacy_none": "the reference: light 15.9; 22.1 ms/step, no threaded preset beats it reliably there (the step "
    "is host-bound, threads share one GIL); with capture_graphs=True and on_nonfinite_loss='stop' 7.5 ms/step "
    "in a process of its own against the plain loop's 11.7 (2026-12-01, night), 4.8-6.0 against 12.0-16.1 "
    "(2026-12-02, three runs); 2 GPUs 27.2 ms, the shuffle "
    "serial with the step",
    "default_d3": "light +9%; +5%",
    "by_stream_d3": "light +8% (2026-11-30)",
    "per_task_d3": "light +29%; +1% (and +17% driven directly): 14 threads take turns on the GIL every step; "
    "2 GPUs -1%",
    "io_prefetch_compute_d3": "light +2% (2026-11-30)",
    "io_data_dist_compute_d3": "light +1% (2026-11-30)",
    "full_split_d3": "light +11% (2026-11-30)",
    "default_d6": "light +11%; -6%; with capture_graphs=True the fastest of both runs (10.6; 12.0 ms/step); "
    "2 GPUs -12% (the shuffle on the io thread); heavy (1 H200, 2026-12-01) +7% through the Trainer, -5% "
    "driven directly",
    "full_split_d6": "light +15%; -7%; 2 GPUs -19% driven directly, but +17% through the Trainer; heavy (1 H200, "
    "2026-12-01) +1% through the Trainer, -5% driven directly, with capture_graphs=True 22.3 ms/step against "
    "the plain loop's 38.7",
}
"""Measured strengths and weaknesses of each preset, one line each (``lightning-hstu presets -v``)."""

DEFAULT_PRESET = "default_d6"
"""The preset of ``HSTUPipelineStrategy()`` and of the CLI when none is named."""


def preset_parts(name: str) -> tuple[str, str | None]:
    """A preset's cascade and thread map; an unknown name raises ``PlanError`` listing the valid ones."""
    if name not in PRESETS:
        raise PlanError(f"unknown preset {name!r}; valid presets: {', '.join(PRESET_NAMES)}")
    return PRESETS[name]


def get_plan(name: str, *, prefetch: bool = True, capturable: Sequence[str] = ()) -> Plan:
    """The plan of a named preset; an unknown name raises ``PlanError`` listing the valid ones."""
    cascade, thread_map = preset_parts(name)
    return make_plan(cascade, thread_map, prefetch, name=name, capturable=capturable)


def resolve_plan(
    preset: str = DEFAULT_PRESET,
    *,
    cascade: str | Mapping[str, int] | None = None,
    thread_map: str | Mapping[str, str] | None = None,
    prefetch: bool = True,
    ticket_order: Sequence[str] | None = None,
    capturable: Sequence[str] = (),
) -> Plan:
    """The plan of ``preset`` with the changes a user asked for; what ``HSTUPipelineStrategy`` and the
    ``lightning-hstu`` command build.

    ``cascade``, ``thread_map`` and ``ticket_order`` replace the preset's own where given (None keeps it;
    ``thread_map="none"`` asks for none: every task on the caller's thread); the result is then a plan
    named "custom", validated like any other. ``prefetch`` and ``capturable`` are options of every plan
    (as in ``get_plan``): they keep the preset's name.
    """
    preset_cascade, preset_thread_map = preset_parts(preset)
    if cascade is None and thread_map is None and ticket_order is None:
        return get_plan(preset, prefetch=prefetch, capturable=capturable)
    return make_plan(
        preset_cascade if cascade is None else cascade,
        preset_thread_map if thread_map is None else thread_map,
        prefetch,
        ticket_order=ticket_order,
        capturable=capturable,
    )


def make_plan(
    cascade: str | Mapping[str, int] = "d6",
    thread_map: str | Mapping[str, str] | None = "default",
    prefetch: bool = True,
    *,
    ticket_order: Sequence[str] | None = None,
    name: str = "custom",
    capturable: Sequence[str] = (),
) -> Plan:
    """A plan of the fourteen HSTU tasks.

    ``cascade``: "d3", "d6" or a mapping task -> lookahead (tasks not named get 0).
    ``thread_map``: a name of ``THREAD_MAPS``, None or "none" for the single-threaded legacy order, or a
    mapping task -> thread name covering every task exactly once.
    ``prefetch``: order this step's embedding-cache prefetch before its backward (a sync edge).
    ``ticket_order``: the collective tasks in launch order (default: plan order).
    ``capturable``: tasks whose body the engine may capture in CUDA graphs (``GRAPH_TASKS``).
    """
    if isinstance(cascade, str):
        if cascade not in CASCADES:
            raise PlanError(
                f"unknown cascade {cascade!r}; valid cascades: {', '.join(CASCADES)} or a mapping task -> lookahead"
            )
        lookahead, cascade_label = CASCADES[cascade], cascade
    else:
        lookahead, cascade_label = cascade, "custom"
    if thread_map == NO_THREAD_MAP:
        thread_map = None
    elif isinstance(thread_map, str):
        if thread_map not in THREAD_MAPS:
            raise PlanError(
                f"unknown thread map {thread_map!r}; valid thread maps: {', '.join(THREAD_MAPS)}, "
                f"{NO_THREAD_MAP!r} or None (legacy) or a mapping task -> thread"
            )
        thread_map = THREAD_MAPS[thread_map]
    return build_plan(
        hstu_tasks(prefetch),
        lookahead,
        thread_map,
        ticket_order=ticket_order,
        name=name,
        cascade=cascade_label,
        capturable=capturable,
    )
