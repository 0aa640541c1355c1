"""The plan layer: pure data. Tasks, lookaheads, thread maps, edges, waits and tickets; no threads, no CUDA."""

from .errors import PlanError
from .graph import Edge, EdgeKind
from .plan import LEGACY_THREAD, Plan, PlanTask, build_plan
from .presets import CASCADES, PRESET_NAMES, PRESETS, THREAD_MAPS, get_plan, make_plan
from .tasks import GRAPH_TASKS, HSTU_TASK_NAMES, INPUT_SLOT, Stream, TaskDef, hstu_tasks

__all__ = [
    "CASCADES", "Edge", "EdgeKind", "GRAPH_TASKS", "HSTU_TASK_NAMES", "INPUT_SLOT", "LEGACY_THREAD", "PRESETS",
    "PRESET_NAMES", "Plan", "PlanError", "PlanTask", "Stream", "TaskDef", "THREAD_MAPS", "build_plan",
    "get_plan", "hstu_tasks", "make_plan",
]
