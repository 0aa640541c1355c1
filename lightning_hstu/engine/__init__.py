"""The engine layer: runs any plan on host threads with the lookahead ring (no Lightning here)."""

from .engine import Engine, TaskObserver, check_step_timeout
from .errors import CallerTimeout, EngineError, LoaderTimeout, PeerFailure, SlotError, StepTimeout, TaskError
from .records import StepResult, TaskRecord, TaskSummary, format_summary, summarize
from .ring import SKIPPED, BatchView
from .watchdog import WATCHDOG_EXIT_CODE, TimeoutActions

__all__ = [
    "BatchView",
    "CallerTimeout",
    "Engine",
    "EngineError",
    "LoaderTimeout",
    "PeerFailure",
    "SKIPPED",
    "SlotError",
    "StepResult",
    "StepTimeout",
    "TaskError",
    "TaskObserver",
    "TaskRecord",
    "TaskSummary",
    "TimeoutActions",
    "WATCHDOG_EXIT_CODE",
    "check_step_timeout",
    "format_summary",
    "summarize",
]
