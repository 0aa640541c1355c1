"""Callbacks that show the engine at work."""

from .report import RankingReport
from .timing import TaskTimingCallback

__all__ = ["RankingReport", "TaskTimingCallback"]
