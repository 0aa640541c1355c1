"""The step that trains one batch, as its lookahead-0 tasks and ``training_step`` see it."""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..engine import Engine
from ..plan import Plan


@dataclass(frozen=True)
class StepContext:
    """Made by the epoch loop before the step that trains batch ``batch_idx`` (between steps, with no task
    running) and valid until that batch ends. A module reads it during its step through
    ``trainer.strategy.step_context`` (None under Lightning's own loop, and outside a training batch)."""

    batch_idx: int
    """The batch this step trains: Lightning's batch index in the epoch, and the engine's step."""
    slots: Mapping[str, Any]
    """The batch's slots, read-only: what the tasks of earlier steps and this step's tasks before the
    reader wrote (``embeddings`` and ``global_tokens`` for ``training_step``)."""
    _engine: Engine
    _all_ranks: Callable[[bool], bool]

    @property
    def plan(self) -> Plan:
        """The plan the engine runs."""
        return self._engine.plan

    @property
    def captured(self) -> bool:
        """The dense forward and backward may be replayed from CUDA graphs in this plan: ``training_step``
        hands them to the module's graphs instead of running them eagerly."""
        return self.plan.task("forward").capturable

    def stream(self, task: str) -> Any:
        """The CUDA stream ``task`` runs on (None on CPU)."""
        return self._engine.stream(self.plan.task(task).stream)

    def all_ranks(self, flag: bool) -> bool:
        """Whether ``flag`` is True on every rank (on a process group of its own: it never interleaves with
        the tasks' collectives). Every rank must ask at the same point of its step."""
        return self._all_ranks(flag)
