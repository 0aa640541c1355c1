"""The engine layer: runs any plan on host threads with the lookahead ring (no Lightning here)."""

from .engine import Engine, TaskObserver
from .errors import EngineError, SlotError, StepTimeout, TaskError
from .records import StepResult, TaskRecord, TaskSummary, format_summary, summarize
from .ring import SKIPPED, BatchView

__all__ = ["BatchView", "Engine", "EngineError", "SKIPPED", "SlotError", "StepResult", "StepTimeout",
           "TaskError", "TaskObserver", "TaskRecord", "TaskSummary", "format_summary", "summarize"]
