"""The engine layer: runs any plan on host threads with the lookahead ring (no Lightning here)."""

from .engine import Engine
from .errors import EngineError, SlotError, StepTimeout, TaskError
from .records import StepResult, TaskRecord, TaskSummary, format_summary, summarize
from .ring import SKIPPED, BatchView

__all__ = ["BatchView", "Engine", "EngineError", "SKIPPED", "SlotError", "StepResult", "StepTimeout",
           "TaskError", "TaskRecord", "TaskSummary", "format_summary", "summarize"]
