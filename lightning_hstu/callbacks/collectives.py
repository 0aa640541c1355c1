"""The seed's collective table, measured: for one chosen step, every collective each task launched, its
operation, payload bytes and the thread that launched it.

Built on torch.profiler (all threads): each task runs inside a ``record_function`` range opened on its own
thread, a launch (``c10d::<op>``) belongs to the engine range that encloses it on the same thread, and its
payload comes from the backend's event of the same operation (``gloo:<op>`` / ``nccl:<op>``), paired in
launch order.
"""

import json
import math
import re
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_only

from ..plan import PlanTask
from ._engine import observe_engine

RANGE_PREFIX = "[engine] "


@dataclass(frozen=True)
class Collective:
    task: str
    batch: int
    thread: str
    operation: str
    payload_bytes: int | None
    """Bytes of the first tensor the backend worked on (None if its event was not found)."""


class CollectiveInventoryCallback(Callback):
    """Records the collectives of the step that trains batch ``batch`` (counted across the fit) on every
    rank; prints rank 0's table and writes ``path`` (JSON) when that batch ends."""

    def __init__(self, batch: int = 5, path: str | None = "collectives.json", print_table: bool = True):
        self.batch, self.path, self.print_table = batch, path, print_table
        self.inventory: list[Collective] = []
        self._seen = 0
        self._profiler = None
        self._ranges = threading.local()

    def setup(self, trainer, pl_module, stage):
        observe_engine(trainer, self)

    # ----- around each task of the chosen step, on its thread ---------------------------------------

    def task_started(self, task: PlanTask, batch: int, step: int, thread: str) -> None:
        if self._profiler is None:
            return
        scope = torch.profiler.record_function(f"{RANGE_PREFIX}{task.name}@{batch}|{thread}")
        scope.__enter__()
        self._ranges.stack = getattr(self._ranges, "stack", []) + [scope]

    def task_ended(self, task: PlanTask, batch: int, step: int, thread: str) -> None:
        stack = getattr(self._ranges, "stack", [])
        if stack:
            stack.pop().__exit__(None, None, None)

    # ----- the chosen step --------------------------------------------------------------------------

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._seen == self.batch:
            from torch._C._profiler import _ExperimentalConfig

            self._profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                experimental_config=_ExperimentalConfig(profile_all_threads=True))
            self._profiler.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._seen += 1
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        self.inventory = inventory_from(profiler.events())
        self._report()

    @rank_zero_only
    def _report(self) -> None:
        if self.path:
            Path(self.path).write_text(json.dumps([asdict(c) for c in self.inventory], indent=1))
        if self.print_table:
            print(format_inventory(self.inventory))


def inventory_from(events) -> list[Collective]:
    ranges = [e for e in events if e.name.startswith(RANGE_PREFIX)]
    launches = sorted((e for e in events if e.name.startswith("c10d::")), key=lambda e: e.time_range.start)
    backend = {}
    for e in sorted(events, key=lambda e: e.time_range.start):
        if e.name.startswith(("gloo:", "nccl:")):
            backend.setdefault(_operation(e.name), []).append(e)
    inventory = []
    for launch in launches:
        owner = next((r for r in ranges if r.thread == launch.thread
                      and r.time_range.start <= launch.time_range.start <= launch.time_range.end <= r.time_range.end),
                     None)
        if owner is None:
            continue  # not launched by an engine task (Lightning's own collectives between steps)
        task_batch, thread = owner.name[len(RANGE_PREFIX):].split("|")
        task, batch = task_batch.split("@")
        operation = _operation(launch.name)
        done = backend.get(operation, [])
        inventory.append(Collective(task, int(batch), thread, operation, _bytes(done.pop(0)) if done else None))
    return inventory


def _operation(name: str) -> str:
    """``c10d::allgather_`` and ``gloo:all_gather`` -> ``allgather``."""
    op = name.split(":")[-1].lower()
    return re.sub(r"_|base|coalesced", "", op)


def _bytes(event) -> int | None:
    """Bytes of the first input of a backend event (an empty shape is a scalar: one element)."""
    shapes, dtypes = event.input_shapes, getattr(event, "input_dtypes", None)
    if not shapes or not dtypes or not dtypes[0]:
        return None
    dtype = _DTYPES.get(dtypes[0]) or getattr(torch, dtypes[0].replace("c10::", "").lower(), None)
    return math.prod(shapes[0]) * dtype.itemsize if isinstance(dtype, torch.dtype) else None


_DTYPES = {"float": torch.float32, "double": torch.float64, "long int": torch.int64, "int": torch.int32,
           "bool": torch.bool}
"""The profiler's C type names that are not torch attribute names (c10::BFloat16 etc. are found by name)."""


def format_inventory(inventory: list[Collective]) -> str:
    header = f"{'task':<24} {'batch':>5} {'thread':<14} {'collective':<14} {'payload bytes':>13}"
    rows = [f"{c.task:<24} {c.batch:>5} {c.thread:<14} {c.operation:<14} "
            f"{'?' if c.payload_bytes is None else c.payload_bytes:>13}" for c in inventory]
    return "\n".join(["collectives of the chosen step:", header, "-" * len(header), *rows])
