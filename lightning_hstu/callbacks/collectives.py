"""The seed's collective table, measured: for one chosen step, every collective each task launched, its
operation, process group, payload bytes, the CUDA stream its kernel ran on and the thread that launched it.

Built on torch.profiler (all threads), read from its exported trace: each task runs inside a
``record_function`` range opened on its own thread, and a launch (``c10d::<op>``) belongs to the engine
range that encloses it on the same thread. The launch records its tensors' shapes and types (the
payload); ``record_param_comms`` inside it names the process group where the backend records it (NCCL;
gloo does not); the CUDA kernel it launched (NCCL) carries its stream.
"""

import json
import math
import re
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_only

from ..plan import PlanTask
from ._engine import observe_engine

RANGE_PREFIX = "[engine] "
AUTOGRAD_THREAD = "autograd"
"""The thread column of a collective that autograd's own device thread launched during the backward task."""


@dataclass(frozen=True)
class Collective:
    task: str
    batch: int
    thread: str
    operation: str
    payload_bytes: int | None
    """Bytes of the launch's first tensor (list) argument (None if the profiler did not record it)."""
    process_group: str | None = None
    """``name (description)`` of the process group, where the backend records it (NCCL; not gloo)."""
    stream: int | None = None
    """The CUDA stream the collective's kernel ran on (NCCL's own stream of the group); None on CPU."""


class CollectiveInventoryCallback(Callback):
    """Records the collectives of the step that trains batch ``batch`` (counted across the fit; or of each
    step of a list of batches) on every rank; prints rank 0's table and writes ``path`` (JSON) when that
    batch ends.

    ``compare_ranks``: a debug mode that checks what the engine's collective tickets promise, that every
    rank launches the same collectives in the same order: after each recorded step the ranks exchange
    their sequences of (task, batch, operation) and, if any differ, every rank raises ``RuntimeError``
    naming the first difference (payload sizes may differ between ranks: all-to-all splits, all-gather-v).

    ``trace_dir``: also keep the profiler trace each inventory was read from there, as
    ``collectives_batch<B>_rank<R>.json`` (Chrome trace format: Perfetto opens it).
    """

    def __init__(
        self,
        batch: int | list[int] = 5,
        path: str | None = "collectives.json",
        print_table: bool = True,
        compare_ranks: bool = False,
        trace_dir: str | None = None,
    ):
        self.batches = {batch} if isinstance(batch, int) else set(batch)
        self.path, self.print_table, self.compare_ranks = path, print_table, compare_ranks
        self.trace_dir = trace_dir
        self.inventory: list[Collective] = []
        """The collectives of the last recorded step, on this rank."""
        self.compared = 0
        """Recorded steps whose sequences were compared across ranks (``compare_ranks``)."""
        self._seen = 0
        self._profiler = None
        self._ranges = threading.local()

    def setup(self, trainer, pl_module, stage):
        observe_engine(trainer, self)

    def on_fit_start(self, trainer, pl_module):
        self._seen = 0  # a second fit of the Trainer: its own batches, not counted on from the first fit's

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
        if self._seen in self.batches:
            from torch._C._profiler import _ExperimentalConfig

            activities = [torch.profiler.ProfilerActivity.CPU]
            if trainer.strategy.root_device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(
                activities=activities,
                record_shapes=True,
                experimental_config=_ExperimentalConfig(profile_all_threads=True),
            )
            self._profiler.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._seen += 1
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp, "trace.json")
            if self.trace_dir is not None:
                Path(self.trace_dir).mkdir(parents=True, exist_ok=True)
                trace = Path(self.trace_dir, f"collectives_batch{self._seen - 1}_rank{trainer.global_rank}.json")
            profiler.export_chrome_trace(str(trace))
            self.inventory = inventory_from(json.loads(trace.read_text())["traceEvents"])
        self._report()
        if self.compare_ranks and dist.is_initialized() and dist.get_world_size() > 1:
            self._compare()

    def _compare(self) -> None:
        """Between steps (no engine task runs): exchange every rank's sequence on the default group."""
        mine = [(c.task, c.batch, c.operation) for c in self.inventory]
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        for rank, theirs in enumerate(every):
            if theirs != every[0]:
                at = next(
                    (i for i, (a, b) in enumerate(zip(every[0], theirs)) if a != b), min(len(every[0]), len(theirs))
                )
                first = lambda seq: seq[at] if at < len(seq) else "nothing"  # noqa: E731
                raise RuntimeError(
                    f"collectives differ between ranks: rank 0 launched {len(every[0])}, rank {rank} "
                    f"{len(theirs)}; first difference at position {at}: rank 0 {first(every[0])}, "
                    f"rank {rank} {first(theirs)} (task, batch, operation)"
                )
        self.compared += 1

    @rank_zero_only
    def _report(self) -> None:
        if self.path:
            Path(self.path).write_text(json.dumps([asdict(c) for c in self.inventory], indent=1))
        if self.print_table:
            print(format_inventory(self.inventory))


def inventory_from(trace_events: list[dict]) -> list[Collective]:
    """The collectives launched inside engine task ranges, from a profiler's exported (Chrome) trace."""
    slices = [e for e in trace_events if e.get("ph") == "X"]
    ranges = [e for e in slices if e["name"].startswith(RANGE_PREFIX)]
    launches = sorted((e for e in slices if e["name"].startswith("c10d::")), key=lambda e: e["ts"])
    comms = [e for e in slices if e["name"] == "record_param_comms"]
    # each launch's record_param_comms (NCCL records one inside it; gloo does not): size and process group
    params = {id(launch): next((e["args"] for e in comms if _inside(e, launch)), {}) for launch in launches}
    payloads = _payloads(slices, launches, params)
    # the launch of a collective's kernel: the runtime API, or the driver's (NCCL launches with cuLaunchKernelEx)
    runtime = [
        e for e in slices if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    ]
    kernels = {
        e["args"]["correlation"]: e
        for e in slices  # (one rank's NCCL may only copy: gpu_memcpy)
        if e.get("cat") in ("kernel", "gpu_memcpy") and "correlation" in e.get("args", {})
    }
    engine_tids = {r["tid"] for r in ranges}
    inventory = []
    for launch in launches:
        owner = next((r for r in ranges if r["tid"] == launch["tid"] and _within(launch, r)), None)
        if owner is not None:
            task_batch, thread = owner["name"][len(RANGE_PREFIX) :].split("|")
        else:
            # On a GPU autograd runs backward on a thread of its own, which launches the backward's
            # collectives (TorchRec's embedding all-to-all) while the backward task waits for it.
            owner = next(
                (
                    r
                    for r in ranges
                    if launch["tid"] not in engine_tids
                    and _within(launch, r)
                    and r["name"][len(RANGE_PREFIX) :].startswith("backward@")
                ),
                None,
            )
            if owner is None:
                continue  # not launched by an engine task (Lightning's own collectives between steps)
            task_batch, thread = owner["name"][len(RANGE_PREFIX) :].split("|")[0], AUTOGRAD_THREAD
        task, batch = task_batch.split("@")
        group = _group(params[id(launch)])
        streams = [
            kernels[e["args"]["correlation"]]["args"].get("stream")
            for e in runtime
            if _inside(e, launch) and e["args"]["correlation"] in kernels
        ]
        operation = _operation(launch["name"])
        inventory.append(
            Collective(
                task, int(batch), thread, operation, payloads[id(launch)], group, streams[0] if streams else None
            )
        )
    return inventory


def _payloads(slices: list[dict], launches: list[dict], params: dict[int, dict]) -> dict[int, int | None]:
    """Each launch's payload bytes, by ``id`` of the launch: from its ``record_param_comms`` (``params``, NCCL)
    or from its backend event (``gloo:<op>``, ``nccl:<op>``). A backend event inside a launch on its thread is
    that launch's; the others ran later on one of a process group's worker threads (gloo), several of which
    may run a group's collectives at once, so not always in launch order: each launch with no size of its
    own, engine task's or not, takes the first event left of its operation that started after it did and
    whose tensor has the shape of one of the launch's tensors."""
    events = sorted((e for e in slices if e["name"].startswith(("gloo:", "nccl:"))), key=lambda e: e["ts"])
    own, queued = {}, {}
    for e in events:
        host = next((launch for launch in launches if _inside(e, launch)), None)
        if host is not None:
            own.setdefault(id(host), e)
        else:
            queued.setdefault(_operation(e["name"]), []).append(e)
    payloads = {}
    for launch in launches:
        size = _comms_bytes(params[id(launch)])
        event = own.get(id(launch))
        if size is None and event is None:
            waiting = queued.get(_operation(launch["name"]), [])
            shapes = _shapes(launch.get("args", {}).get("Input Dims"))
            at = next(
                (
                    i
                    for i, e in enumerate(waiting)
                    if e["ts"] >= launch["ts"] and (not shapes or _first_shape(e) in shapes)
                ),
                None,
            )
            event = waiting.pop(at) if at is not None else None
        payloads[id(launch)] = size if size is not None or event is None else _bytes(event["args"])
    return payloads


def _shapes(dims) -> list[list[int]]:
    """The tensor shapes among a launch's recorded argument dimensions (tensor lists opened)."""
    if not isinstance(dims, list):
        return []
    if all(isinstance(d, int) for d in dims):
        return [dims]
    return [shape for d in dims for shape in _shapes(d)]


def _first_shape(event: dict) -> list[int] | None:
    dims = event.get("args", {}).get("Input Dims")
    return dims[0] if dims and isinstance(dims[0], list) else None


def _inside(event: dict, launch: dict) -> bool:
    return event["tid"] == launch["tid"] and _within(event, launch)


def _within(inner: dict, outer: dict) -> bool:
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner.get("dur", 0) <= outer["ts"] + outer.get("dur", 0)


def _group(args: dict) -> str | None:
    name = args.get("Process Group Name")
    if name is None:
        return None
    description = args.get("Process Group Description")
    return f"{name} ({description})" if description and description != "undefined" else str(name)


def _operation(name: str) -> str:
    """``c10d::allgather_`` and ``gloo:all_gather`` -> ``allgather``."""
    op = name.split(":")[-1].lower()
    return re.sub(r"_|base|coalesced", "", op)


def _bytes(args: dict) -> int | None:
    """Bytes of the first input of a backend event (an empty shape is a scalar: one element)."""
    shapes, types = args.get("Input Dims"), args.get("Input type")
    if not shapes or not types or not types[0] or not isinstance(shapes[0], list):
        return None
    dtype = _dtype(types[0])
    return math.prod(shapes[0]) * dtype.itemsize if dtype is not None else None


def _comms_bytes(args: dict) -> int | None:
    """Bytes of a collective's input from its ``record_param_comms`` record (element count and dtype)."""
    count, dtype = args.get("In msg nelems"), _dtype(args.get("dtype"))
    return int(count) * dtype.itemsize if isinstance(count, int) and dtype is not None else None


def _dtype(name: str | None) -> torch.dtype | None:
    if not name:
        return None
    dtype = _DTYPES.get(name.lower()) or getattr(torch, name.replace("c10::", "").lower(), None)
    return dtype if isinstance(dtype, torch.dtype) else None


_DTYPES = {
    "float": torch.float32,
    "double": torch.float64,
    "long int": torch.int64,
    "int": torch.int32,
    "bool": torch.bool,
}
"""The profiler's C type names that are not torch attribute names (c10::BFloat16 etc. are found by name)."""


def format_inventory(inventory: list[Collective]) -> str:
    header = (
        f"{'task':<24} {'batch':>5} {'thread':<14} {'collective':<14} {'payload bytes':>13} "
        f"{'process group':<20} {'stream':>6}"
    )
    rows = [
        f"{c.task:<24} {c.batch:>5} {c.thread:<14} {c.operation:<14} "
        f"{'?' if c.payload_bytes is None else c.payload_bytes:>13} {c.process_group or '?':<20} "
        f"{'-' if c.stream is None else c.stream:>6}"
        for c in inventory
    ]
    return "\n".join(["collectives of the chosen step:", header, "-" * len(header), *rows])
