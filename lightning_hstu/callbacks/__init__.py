"""Callbacks that show the engine at work (NVTX ranges, per-task timing, traces and pictures), report the
ranking metrics and write recommendations."""

from .collectives import CollectiveInventoryCallback
from .nvtx_ranges import NVTXCallback
from .recommendations import RecommendationWriter
from .report import RankingReport
from .summary import FitSummary
from .throughput import HSTUThroughputMonitor
from .timing import TaskTimingCallback
from .trace import GanttCallback, TraceCallback

__all__ = [
    "CollectiveInventoryCallback",
    "FitSummary",
    "GanttCallback",
    "HSTUThroughputMonitor",
    "NVTXCallback",
    "RankingReport",
    "RecommendationWriter",
    "TaskTimingCallback",
    "TraceCallback",
]
