"""The plan layer: pure data. Tasks, lookaheads, thread maps, edges, waits and tickets; no threads, no CUDA.

Generic: any set of task definitions can be planned (``build_plan``); a workload's own tasks, cascades,
thread maps and presets live with the workload's code.
"""

from .errors import PlanError
from .graph import Edge, EdgeKind
from .plan import LEGACY_THREAD, Plan, PlanTask, build_plan
from .tasks import INPUT_SLOT, Stream, TaskDef

__all__ = [
    "Edge",
    "EdgeKind",
    "INPUT_SLOT",
    "LEGACY_THREAD",
    "Plan",
    "PlanError",
    "PlanTask",
    "Stream",
    "TaskDef",
    "build_plan",
]
