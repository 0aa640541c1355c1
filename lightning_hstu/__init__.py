"""lightning-hstu: a Lightning strategy that trains HSTU recommenders with a lookahead-ring task engine.

Layers, lowest first: ``plan`` (pure data) -> ``engine`` (runs any plan) -> HSTU tasks -> strategy and
loop -> callbacks and CLI. Lower layers never import upper ones.
"""

from .engine import SKIPPED, Engine, EngineError, StepTimeout, TaskError, TaskRecord
from .hstu.presets import PRESET_NAMES, get_plan, make_plan
from .plan import Plan, PlanError, Stream
from .strategies import HSTUPipelineStrategy  # registers "hstu_<preset>" with Lightning

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "EngineError",
    "HSTUPipelineStrategy",
    "PRESET_NAMES",
    "Plan",
    "PlanError",
    "SKIPPED",
    "StepTimeout",
    "Stream",
    "TaskError",
    "TaskRecord",
    "get_plan",
    "make_plan",
]
