"""The lookahead-ring threaded engine: executes any valid plan over an iterator of batches.

Step ``k`` runs every task on batch ``k + lookahead``. The caller's thread pulls batch ``k + depth - 1``
into the ring, hands the step to every worker thread (one per thread of the plan), and waits for all of
them: the step barrier. Inside a step a task waits only for its plan wait edges and, if it launches
collectives, for the previous ticket holder. The first steps (the fill) and the last ones (the drain)
simply skip tasks whose batch does not exist, so every batch passes every task exactly once.
"""

import contextlib
import math
import numbers
import queue
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from time import monotonic, perf_counter
from types import MappingProxyType
from typing import Any, Protocol

from ..plan import LEGACY_THREAD, Plan, PlanError, PlanTask, Stream
from .errors import CallerTimeout, EngineError, LoaderTimeout, PeerFailure, StepTimeout, TaskError
from .records import StepResult, TaskRecord
from .ring import SKIPPED, BatchView, Ring, RingEntry
from .schedule import Body, ScheduledTask, schedule
from .streams import make_streams
from .watchdog import POLL_S, TimeoutActions, Watch, Watchdog, WatchKind, call_bounded


def check_step_timeout(value: Any) -> float | None:
    """``value`` as a step timeout in seconds (None: wait forever); anything else raises ``PlanError``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise PlanError(f"step_timeout must be a positive number of seconds, or None to wait forever; got {value!r}")
    return float(value)


class _Signal:
    """Set once, waited on by any number of threads. A bare C lock: ``threading.Event`` is a Python-level
    Condition and cost most of the engine's per-task overhead with one thread per task."""

    __slots__ = ("_lock",)

    def __init__(self):
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:  # already set (by the producer, or by an abort)
            pass

    def is_set(self) -> bool:
        return not self._lock.locked()

    def wait(self, timeout: float = -1) -> bool:
        if not self._lock.acquire(timeout=timeout):
            return False
        self._lock.release()
        return True


@dataclass(frozen=True)
class _StepShape:
    """What follows from which tasks run in a step (all of them, or fewer in the fill and the drain).

    Derived once per shape from the plan's wait edges and ticket order, then reused for every step.
    """

    threads: tuple[str, ...]
    """Threads with at least one task in this step; the others are not woken."""
    signalled: tuple[str, ...]
    """Running tasks that another thread waits for."""
    ticket_prev: Mapping[str, str]
    """Collective -> the collective before it in this step, where that one runs on another thread
    (on the same thread, the thread's own order already ensures it)."""
    gates: Mapping[str, tuple[str, tuple[str, ...]]]
    """Thread -> (its first task, the producers that task waits for). Such a thread is handed the step only
    when they are done: waking it earlier would only make it block again (a thread switch costs tens of
    microseconds under the GIL on a small machine)."""
    opens: Mapping[str, tuple[str, ...]]
    """Producer -> the gated threads whose gate its completion counts towards."""


class _Step:
    """What the threads of one step share: which batches exist, completion signals, the first failure."""

    __slots__ = (
        "index",
        "first",
        "limit",
        "ring",
        "shape",
        "done",
        "records",
        "failure",
        "aborted",
        "finished",
        "dispatched_at",
        "_inboxes",
        "_gates",
        "_threads_left",
        "_lock",
    )

    def __init__(
        self,
        index: int,
        first: int,
        limit: int | None,
        ring: Ring,
        shape: _StepShape,
        inboxes: Mapping[str, queue.SimpleQueue],
    ):
        self.index, self.first, self.limit, self.ring, self.shape = index, first, limit, ring, shape
        self.done = {name: _Signal() for name in shape.signalled}
        self.records: list[TaskRecord] = []
        self.failure: tuple[BaseException, BaseException] | None = None
        self.aborted = False
        self.finished = _Signal()
        """The step barrier: set by the last thread to finish its tasks of this step."""
        self.dispatched_at = 0.0
        self._inboxes = inboxes
        self._gates = {thread: len(producers) for thread, (_, producers) in shape.gates.items()}
        self._threads_left = len(shape.threads)
        self._lock = threading.Lock()

    def dispatch(self) -> None:
        """Hand the step to every thread that can start now; gated ones follow as their producers finish."""
        self.dispatched_at = perf_counter()
        for thread in self.shape.threads:
            if thread not in self._gates:
                self._inboxes[thread].put(self)

    def task_done(self, name: str) -> None:
        done = self.done.get(name)
        if done is None:
            return
        done.set()
        for thread in self.shape.opens.get(name, ()):
            with self._lock:
                self._gates[thread] -= 1
                ready = self._gates[thread] == 0
            if ready:
                self._inboxes[thread].put(self)

    def thread_finished(self) -> None:
        # One wake-up of the caller per step, not one per thread.
        with self._lock:
            self._threads_left -= 1
            last = self._threads_left == 0
        if last:
            self.finished.set()

    def gate_of(self, thread: str) -> tuple[str, tuple[str, ...]] | None:
        """(first task, producers) if ``thread`` has not been handed the step yet, else None."""
        with self._lock:
            waiting = self._gates.get(thread, 0) > 0
        return self.shape.gates[thread] if waiting else None

    def has_batch(self, batch: int) -> bool:
        return batch >= self.first and (self.limit is None or batch < self.limit)

    def fail(self, error: BaseException, cause: BaseException) -> None:
        """Keep the first failure (the root cause) and wake every thread waiting in this step."""
        with self._lock:
            if self.failure is None:
                self.failure = (error, cause)
        self.abort()

    def abort(self) -> None:
        """Wake every waiter and hand the step to every gated thread, so that each one finishes it."""
        self.aborted = True
        for signal in self.done.values():
            signal.set()
        with self._lock:
            gated = [thread for thread, left in self._gates.items() if left > 0]
            for thread in gated:
                self._gates[thread] = 0
        for thread in gated:
            self._inboxes[thread].put(self)


class _LoaderThread:
    """Pulls the batches on an engine thread of its own while the caller waits with the step timeout: a
    caller stuck inside the loader's ``next()`` could not time itself. One pull at a time, so the loader is
    never used by two threads at once.

    ``ask`` starts the next pull when a step is dispatched, so that the loader works while the step runs
    and the caller's next ``pull`` finds its batch waiting (the loader is one batch ahead of the ring); not
    earlier, while the caller runs Lightning's hooks between two steps: both are Python, and under the GIL
    a loader's Python work (a collate function's) would lengthen that section, which no step overlaps.
    ``settle`` ends a run: it waits for that pull ahead and drops its batch, so that the iterator is not
    used after the run."""

    def __init__(self, enter_thread: Callable[[], None]):
        self._enter_thread = enter_thread
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._ahead: Iterator[Any] | None = None  # the iterator whose next batch is asked for
        self.pulling: tuple[int, str] | None = None
        """(batch, source) of the pull the thread is in (None while it waits for a request)."""
        self.thread = threading.Thread(target=self._run, name="hstu-loader", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._requests.put(None)

    def pull(self, iterator: Iterator[Any], check: Callable[[], None], batch: int, source: str) -> Any:
        """Batch ``batch``, the next of ``iterator`` (``StopIteration`` at its end; the loader's own errors are
        raised as themselves): the pull ``ask`` started, or one started now. ``check()`` runs every ``POLL_S``
        while the caller waits: it raises the step timeout."""
        if self._ahead is not iterator:
            self.settle(check)
            self._requests.put((iterator, (batch, source)))
        self._ahead = None
        ok, value = self._wait(check)
        if not ok:
            raise value
        return value

    def ask(self, iterator: Iterator[Any], batch: int, source: str) -> None:
        """Start pulling batch ``batch``, the next of ``iterator``, unless a pull is under way already."""
        if self._ahead is None:
            self._requests.put((iterator, (batch, source)))
            self._ahead = iterator

    def settle(self, check: Callable[[], None]) -> None:
        """Wait for the pull ahead, if one was asked for, and drop what it gave."""
        if self._ahead is not None:
            self._ahead = None
            self._wait(check)

    def _wait(self, check: Callable[[], None]) -> tuple[bool, Any]:
        while True:
            try:
                return self._results.get(timeout=POLL_S)
            except queue.Empty:
                pass
            check()

    def _run(self) -> None:
        try:
            self._enter_thread()  # pinned memory and the like go to this rank's device
        except BaseException as exc:
            setup_error: BaseException | None = exc
        else:
            setup_error = None
        while (request := self._requests.get()) is not None:
            iterator, self.pulling = request
            if setup_error is not None:
                result = (False, EngineError(f"the loader thread could not enter its device: {setup_error}"))
            else:
                try:
                    result = (True, next(iterator))
                except BaseException as exc:  # StopIteration included: the caller sees the end of data
                    result = (False, exc)
            self.pulling = None
            self._results.put(result)
            del result  # the batch is the caller's now


def _stack_of(thread: threading.Thread, depth: int = 10) -> str:
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return ""
    stack = "".join(traceback.format_stack(frame)[-depth:])
    return "\n".join("      " + line for line in stack.rstrip().splitlines())


class TaskObserver(Protocol):
    """Called on the thread that runs each task, right around its body and inside its CUDA stream (NVTX
    ranges, profilers, CUDA events). ``task_ended`` is called also when the body raised."""

    def task_started(self, task: PlanTask, batch: int, step: int, thread: str) -> None: ...

    def task_ended(self, task: PlanTask, batch: int, step: int, thread: str) -> None: ...


class TaskGraphs(Protocol):
    """CUDA graphs of (part of) a capturable task's body, captured by the engine between steps."""

    def pending(self) -> list: ...

    """What is ready to be captured (empty: nothing to do)."""

    def capture(self) -> list[str]: ...

    """Capture it; no engine task runs meanwhile. Returns what was captured, described."""


class Engine:
    """Runs ``plan`` with one body per task. Use as a context manager, or ``start()`` and ``close()``.

    ``bodies`` maps every task to ``body(batch) -> None`` (``batch`` is a ``BatchView``: its slots and
    index) or to None when the task has nothing to do. ``device``: a CUDA device makes every task run on
    its plan stream with per-(task, batch) events; None or a CPU device runs on the host alone.
    ``step_timeout``: seconds after which a step that has not finished, a batch the loader has not given,
    or the caller's own work around a step (``before_step``, ``watched``) that has not returned, is reported
    and aborted; None waits forever. A thread cannot time itself, so with a timeout a watchdog thread
    (``hstu-watchdog``, see ``watchdog.py``) keeps the deadlines, the batches are pulled on an engine thread
    (``hstu-loader``) and a legacy plan's tasks run on one engine thread (``hstu-main``) while the caller
    waits; without one, both run on the caller's thread. ``on_timeout``: what a timeout does besides the
    report (name the rank, list the collectives in flight, abort the process groups, end the process);
    by default it only reports. ``observers``:
    ``TaskObserver``s called around every task body, on the thread that runs it. ``graphs``: task ->
    ``TaskGraphs`` for tasks the plan marks capturable; between two steps, while no task runs, the engine
    captures what they have pending, on the task's stream (a capture records the work of every stream of
    the device, so it must not overlap other tasks).
    """

    def __init__(
        self,
        plan: Plan,
        bodies: Mapping[str, Body | None],
        *,
        device: Any = None,
        step_timeout: float | None = None,
        join_timeout: float = 10.0,
        observers: Iterable["TaskObserver"] = (),
        graphs: Mapping[str, TaskGraphs] | None = None,
        on_timeout: TimeoutActions | None = None,
    ):
        self.plan = plan
        graphs = dict(graphs or {})
        refused = [name for name in graphs if name not in plan.capturable]
        if refused:
            raise EngineError(
                f"graphs given for {refused}, which plan '{plan.name}' does not mark capturable; "
                f"capturable tasks: {', '.join(plan.capturable) or 'none'}"
            )
        self._graphs = graphs
        self.captured: list[tuple[str, str]] = []
        """(task, what) for every capture so far."""
        self._observers = tuple(observers)
        self.step_timeout = check_step_timeout(step_timeout)
        self._on_timeout = on_timeout or TimeoutActions()
        self._watchdog: Watchdog | None = None
        self._program = schedule(plan, bodies)
        self._lookahead = {t.name: t.lookahead for t in plan.tasks}
        self._thread_of = {t.name: t.thread for t in plan.tasks}
        self._wait_producers = frozenset(p for p, _ in plan.wait_edges)
        self._streams = make_streams(device)
        if (
            isinstance(join_timeout, bool)
            or not isinstance(join_timeout, numbers.Real)
            or not 0 <= join_timeout <= threading.TIMEOUT_MAX
        ):
            raise EngineError(
                f"join_timeout must be a number of seconds from 0 to {threading.TIMEOUT_MAX:g}; got {join_timeout!r}"
            )
        self._join_timeout = float(join_timeout)
        self._workers: dict[str, threading.Thread] = {}
        self._loader: _LoaderThread | None = None
        self._current: tuple[int, _Step | None] = (0, None)  # the step running (or last run) and its state
        self._inboxes: dict[str, queue.SimpleQueue] = {}
        self._activity: dict[str, tuple] = {}
        self._host_waits = {s.task.name: s.host_waits for tasks in self._program.values() for s in tasks}
        self._step_shapes: dict[tuple[str, ...], _StepShape] = {}
        self._ring: Ring | None = None
        self._state = "new"

    # ----- lifecycle -------------------------------------------------------------------------------

    def start(self) -> "Engine":
        if self._state != "new":
            raise EngineError(f"engine already {self._state}; an engine starts once")
        self._state = "running"
        if self.step_timeout is not None:
            self._watchdog = Watchdog(self.step_timeout, self._timeout_report, self._on_timeout).start()
            self._loader = _LoaderThread(self._streams.enter_thread)
            self._loader.start()
        if not self.plan.legacy or self.step_timeout is not None:
            for thread in self.plan.threads:
                inbox: queue.SimpleQueue = queue.SimpleQueue()
                worker = threading.Thread(target=self._worker, args=(thread, inbox), name=f"hstu-{thread}", daemon=True)
                self._inboxes[thread], self._workers[thread] = inbox, worker
                self._activity[thread] = ("idle",)
                worker.start()
        return self

    def close(self) -> None:
        """Stop and join every worker thread. Safe to call twice, and after a failure."""
        if self._state == "closed":
            return
        self._state = "closed"
        join_timeout = self._join_timeout
        if self._watchdog is not None:
            self._watchdog.close()
            if self._watchdog.expired is not None and self._on_timeout.end_process:
                join_timeout = POLL_S  # threads stuck in a collective do not return; the process is ending
        for inbox in self._inboxes.values():
            inbox.put(None)
        threads = dict(self._workers)
        if self._loader is not None:
            self._loader.stop()
            threads["loader"] = self._loader.thread
        deadline = monotonic() + join_timeout
        for worker in threads.values():
            worker.join(max(0.0, deadline - monotonic()))
        stuck = [name for name, worker in threads.items() if worker.is_alive()]
        if stuck:
            warnings.warn(
                f"engine threads {stuck} did not stop within {join_timeout:g} s (still inside a task body or a pull)",
                RuntimeWarning,
                stacklevel=2,
            )

    def threads(self) -> list[threading.Thread]:
        """The threads this engine started that run tasks or pull batches (its workers and its loader thread;
        not the watchdog), alive or not."""
        loader = [self._loader.thread] if self._loader is not None else []
        return [*self._workers.values(), *loader]

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def stream(self, which: Stream) -> Any:
        """The CUDA stream that tasks of stream ``which`` run on (None without CUDA)."""
        return self._streams.stream(which)

    def watched(self, what: str) -> contextlib.AbstractContextManager:
        """Time the caller's own work between two steps with the step timeout (a hook that may wait for the
        device or launch a collective); ``what`` names it in the report. A no-op without a timeout."""
        return self._watch(WatchKind.CALLER, self._current[0], what)

    def paused(self) -> contextlib.AbstractContextManager:
        """No deadline runs in the block: the caller's work that may rightly take longer than a step (writing
        a checkpoint). The watches open around it start over when it ends. A no-op without a timeout."""
        return contextlib.nullcontext() if self._watchdog is None else self._watchdog.paused()

    def _watch(self, kind: WatchKind, step: int, what: str, **details: Any) -> contextlib.AbstractContextManager:
        if self._watchdog is None:
            return contextlib.nullcontext()
        return self._watchdog.watch(kind, step, what, **details)

    # ----- running ---------------------------------------------------------------------------------

    def run(self, batches: Iterable[Any]) -> list[TaskRecord]:
        """Run every batch through every task; return all task records."""
        return [record for result in self.steps(batches) for record in result.records]

    def steps(
        self,
        batches: Iterable[Any],
        before_step: Callable[[int], bool] | None = None,
        *,
        start: int = 0,
        source: str | None = None,
    ) -> Iterator[StepResult]:
        """Run step by step, yielding after each step barrier (no task of the engine is running then).

        The batches are numbered from ``start`` (a run that resumes an epoch numbers its batches as the
        epoch does); step ``k`` trains batch ``k``.

        ``before_step(k)`` runs on the caller's thread before any task of step ``k`` starts, for every step:
        the fill steps too (``k`` from ``start - depth + 1`` to ``start - 1``: no batch has reached lookahead 0
        yet, and ``slots(k)`` of such a ``k`` raises), then once step ``k``'s batch is in the ring
        (``slots(k)`` shows it); returning False ends the run there.
        Stopping early (``max_steps``) leaves the engine usable; the batches already pulled into the ring
        are dropped. A failure closes the engine and raises ``TaskError``/``StepTimeout`` (``LoaderTimeout``
        when the loader gave no batch in time; ``source`` names the loader there, by default the iterable's
        type or generator).
        """
        if self._state != "running":
            raise EngineError(f"engine is {self._state}; call start() (or use it as a context manager)")
        iterator = iter(batches)
        source = source or _describe_source(batches)
        self._ring = ring = Ring(self.plan.depth)
        limit: int | None = None  # the end of the batch numbers, once the iterator is exhausted
        index = start - (self.plan.depth - 1)  # the fill: steps before the first batch reaches lookahead 0
        try:
            while True:
                self._current = (index, None)
                if limit is None:
                    limit = self._pull(iterator, ring, index + self.plan.depth - 1, index, source)
                if limit is not None and index >= limit:
                    break
                if before_step is not None:
                    with self._watch(WatchKind.CALLER, index, f"before_step({index}) ({_name_of(before_step)})"):
                        go_on = before_step(index)
                    if not go_on:
                        break
                if limit is None and self._loader is not None:  # the next batch, pulled while this step runs
                    self._loader.ask(iterator, index + self.plan.depth, source)
                step = self._run_step(index, start, limit, ring)
                if step is not None:
                    trained = index if step.has_batch(index) else None
                    yield StepResult(index, trained, tuple(step.records))
                ring.retire(index)
                index += 1
        except GeneratorExit:
            self._settle_loader(index, source)
            raise
        except BaseException:
            self.close()
            raise
        self._settle_loader(index, source)

    def _run_step(self, index: int, first: int, limit: int | None, ring: Ring) -> "_Step | None":
        with self._watch(WatchKind.STEP, index, f"waiting for the step barrier of step {index}"):
            self._capture_graphs()
            step = self._new_step(index, first, limit, ring)
            if step is None:
                return None
            self._current = (index, step)
            self._dispatch(step)
        self._raise_failure(step)
        return step

    def _capture_graphs(self) -> None:
        """Between steps: no worker runs a task, so a capture sees no other thread's GPU work."""
        if not self._streams.enabled:
            return
        for name, graphs in self._graphs.items():
            if graphs.pending():
                self._streams.enter_thread()
                with self._streams.use(self.plan.task(name).stream):
                    self.captured.extend((name, what) for what in graphs.capture())

    def slots(self, index: int) -> Mapping[str, Any]:
        """The slots of batch ``index`` of the current run, read-only; call it between steps only."""
        if self._ring is None:
            raise EngineError("no run in progress")
        return MappingProxyType(self._ring.get(index).slots)

    def _pull(self, iterator: Iterator[Any], ring: Ring, index: int, step: int, source: str) -> int | None:
        """Put batch ``index`` into the ring; return the batch count once the iterator is exhausted."""
        try:
            if self._loader is None:
                batch = next(iterator)
            else:
                what = f"waiting for batch {index} from the loader thread"
                with self._watch(WatchKind.LOADER, step, what, batch=index, source=source):
                    batch = self._loader.pull(iterator, self._watchdog.raise_expired, index, source)
        except StopIteration:
            return index
        ring.put(index, batch)
        return None

    def _settle_loader(self, step: int, source: str) -> None:
        """At the end of a run: wait for the loader thread's pull ahead (its batch is dropped, as those in
        the ring are), so that nothing uses the run's iterator once ``steps`` has returned."""
        if self._loader is None or self._state != "running":
            return
        batch = step + self.plan.depth  # the batch step + 1 would have put into the ring
        what = f"waiting for the loader thread's pull of batch {batch} to end (the run is over; dropped)"
        with self._watch(WatchKind.LOADER, step + 1, what, batch=batch, source=source):
            self._loader.settle(self._watchdog.raise_expired)

    def _new_step(self, index: int, first: int, limit: int | None, ring: Ring) -> _Step | None:
        running = tuple(
            name
            for name, la in self._lookahead.items()
            if index + la >= first and (limit is None or index + la < limit)
        )
        if not running:
            return None
        if running not in self._step_shapes:
            self._step_shapes[running] = self._step_shape(running)
        return _Step(index, first, limit, ring, self._step_shapes[running], self._inboxes)

    def _step_shape(self, running: tuple[str, ...]) -> _StepShape:
        if self.plan.legacy:
            return _StepShape((LEGACY_THREAD,), (), {}, {}, {})
        ticket_prev: dict[str, str] = {}
        previous = None
        for name in self.plan.ticket_order:
            if name in running:
                if previous is not None and self._thread_of[previous] != self._thread_of[name]:
                    ticket_prev[name] = previous
                previous = name
        signalled = tuple(n for n in running if n in self._wait_producers or n in ticket_prev.values())
        first_task = {}
        for name in running:
            first_task.setdefault(self._thread_of[name], name)
        gates, opens = {}, {}
        for thread, name in first_task.items():
            producers = {p for p in self._host_waits[name] if p in running}
            producers |= {ticket_prev[name]} if name in ticket_prev else set()
            if producers:
                gates[thread] = (name, tuple(sorted(producers)))
                for producer in producers:
                    opens[producer] = opens.get(producer, ()) + (thread,)
        threads = tuple(t for t in self.plan.threads if t in first_task)
        return _StepShape(threads, signalled, ticket_prev, gates, opens)

    def _dispatch(self, step: _Step) -> None:
        if not self._workers:  # a legacy plan without a timeout: the caller runs it
            self._run_tasks(LEGACY_THREAD, step)
            return
        step.dispatch()
        try:
            # Wake now and then to let a KeyboardInterrupt in and to raise the watchdog's timeout.
            while not step.finished.wait(POLL_S):
                if self._watchdog is not None:
                    self._watchdog.raise_expired()
        except BaseException:
            step.abort()  # wake every thread waiting in this step, so that close() can join them
            raise

    @staticmethod
    def _raise_failure(step: _Step) -> None:
        if step.failure is None:
            return
        error, cause = step.failure
        if not isinstance(cause, Exception):
            raise cause  # KeyboardInterrupt, SystemExit: the caller handles them as such
        raise error from cause

    # ----- worker side -----------------------------------------------------------------------------

    def _worker(self, thread: str, inbox: queue.SimpleQueue) -> None:
        setup_error: BaseException | None = None
        try:
            self._streams.enter_thread()
        except BaseException as exc:  # report it with the first step rather than die silently
            setup_error = exc
        while (step := inbox.get()) is not None:
            try:
                if setup_error is not None:
                    step.fail(EngineError(f"thread '{thread}' could not enter its device: {setup_error}"), setup_error)
                else:
                    self._run_tasks(thread, step)
            except BaseException as exc:  # a bug of the engine itself: still end the step
                step.fail(EngineError(f"engine failure on thread '{thread}': {exc}"), exc)
            finally:
                self._activity[thread] = ("idle",)
                step.thread_finished()

    def _run_tasks(self, thread: str, step: _Step) -> None:
        # A gated thread was handed the step only once its first task's producers were done: that task
        # waited from the dispatch, on them (the record must show the wait the gate replaced).
        gate = step.shape.gates.get(thread)
        for scheduled in self._program[thread]:
            task = scheduled.task
            batch = step.index + task.lookahead
            if not step.has_batch(batch):
                continue
            waited_from = perf_counter() if gate is None else step.dispatched_at
            waited_on = self._wait_for_producers(thread, scheduled, batch, step)
            if gate is not None:
                waited_on, gate = gate[1] + waited_on, None
            if step.aborted:
                return
            start = perf_counter()
            self._activity[thread] = ("running", task.name, batch)
            entry = step.ring.get(batch)
            try:
                result = self._call(scheduled, entry, step, thread)
            except BaseException as exc:
                step.fail(TaskError(task.name, batch, step.index, thread, exc), exc)
                return
            end = perf_counter()
            step.task_done(task.name)
            step.records.append(
                TaskRecord(
                    task.name, batch, step.index, thread, start, end, start - waited_from, result is SKIPPED, waited_on
                )
            )

    def _wait_for_producers(self, thread: str, scheduled: ScheduledTask, batch: int, step: _Step) -> tuple[str, ...]:
        """Block until this step's producers of the task are done; return those it actually waited for."""
        name = scheduled.task.name
        blocked = [p for p in scheduled.host_waits if self._wait(thread, step, p, ("waiting for", p, name, batch))]
        holder = step.shape.ticket_prev.get(name)
        if holder is not None and self._wait(
            thread, step, holder, ("waiting for the ticket after", holder, name, batch)
        ):
            blocked.append(holder)
        return tuple(blocked)

    def _wait(self, thread: str, step: _Step, producer: str, activity: tuple) -> bool:
        done = step.done.get(producer)  # absent: the producer does not run in this step
        if done is None or done.is_set():
            return False
        self._activity[thread] = activity
        done.wait()
        return True

    def _call(self, scheduled: ScheduledTask, entry: RingEntry, step: _Step, thread: str) -> Any:
        if not self._streams.enabled:
            return self._body(scheduled, entry, step, thread)
        streams, task = self._streams, scheduled.task
        with streams.use(task.stream):
            for edge in scheduled.stream_inputs:
                batch = entry.index if edge.same_batch else step.index + edge.producer_lookahead
                if not step.has_batch(batch):
                    continue  # a sync producer with nothing to do in this step
                producer_entry = entry if edge.same_batch else step.ring.get(batch)
                streams.wait(task.stream, producer_entry.events[edge.producer])
                for slot in edge.slots:
                    streams.keep_alive(entry.slots.get(slot), task.stream)
            result = self._body(scheduled, entry, step, thread)
            if scheduled.records_event:
                entry.events[task.name] = streams.record(task.stream)
        return result

    def _body(self, scheduled: ScheduledTask, entry: RingEntry, step: _Step, thread: str) -> Any:
        """The task's body between its observers (inside its stream, so that they can record events on it)."""
        task = scheduled.task
        for observer in self._observers:
            observer.task_started(task, entry.index, step.index, thread)
        try:
            return SKIPPED if scheduled.body is None else scheduled.body(BatchView(entry, task, step.index))
        finally:
            for observer in self._observers:
                observer.task_ended(task, entry.index, step.index, thread)

    # ----- the timeout report (built on the watchdog's thread while the others hang) --------------------

    def _timeout_report(self, watch: Watch, failure: str | None = None) -> StepTimeout:
        step = self._current[1]
        activity = self._describe_activity(step)
        if self._loader is not None:
            pulling = self._loader.pulling
            activity["loader"] = (
                "idle (no pull in progress)"
                if pulling is None
                else f"pulling batch {pulling[0]} from {pulling[1]}\n{_stack_of(self._loader.thread)}"
            )
        caller = f"{watch.what}, on thread '{watch.thread.name}'"
        if watch.kind == WatchKind.CALLER:
            caller += "\n" + _stack_of(watch.thread)
        activity["caller"] = caller
        details = dict(rank=self._on_timeout.rank, collectives=self._collectives_in_flight())
        if failure is not None:
            return PeerFailure(watch.step, self.step_timeout, failure, activity, **details)
        if watch.kind == WatchKind.LOADER:
            return LoaderTimeout(watch.step, watch.batch, self.step_timeout, watch.source, activity, **details)
        if watch.kind == WatchKind.CALLER:
            return CallerTimeout(watch.step, self.step_timeout, watch.what, activity, **details)
        return StepTimeout(watch.step, self.step_timeout, activity, **details)

    def _collectives_in_flight(self) -> list[str] | None:
        """What the owner's recorder lists (torch's flight recorder), then the engine's own view: collective
        tasks whose body has not returned, and, on a GPU, those whose stream work has not completed. Each
        source that could block (a recorder's dump, the device) is waited for a bounded time."""
        recorded = None
        if self._on_timeout.collectives_in_flight is not None:
            recorded = call_bounded(self._on_timeout.collectives_in_flight, "reading the collectives in flight") or []
        engine = [
            f"engine: task '{activity[1]}' on batch {activity[2]} (thread '{thread}') launches collectives "
            f"and has not returned"
            for thread, activity in list(self._activity.items())
            if activity[0] == "running" and self.plan.task(activity[1]).collective
        ]
        if self._streams.enabled and self._ring is not None:
            engine += call_bounded(self._collective_work_not_done, "querying the tasks' CUDA events") or []
        if recorded is None and not engine:
            return None
        return [*(recorded or []), *engine]

    def _collective_work_not_done(self) -> list[str]:
        lines = []
        for entry in self._ring.entries():
            for name, event in list(entry.events.items()):
                task = self.plan.task(name)
                if task.collective and not event.query():
                    lines.append(
                        f"engine: task '{name}' on batch {entry.index} returned, but its work on stream "
                        f"'{task.stream}' has not completed"
                    )
        return lines

    def _describe_activity(self, step: _Step | None) -> dict[str, str]:
        frames = sys._current_frames()
        report = {}
        for thread, worker in self._workers.items():
            activity = self._activity.get(thread, ("idle",))
            gate = None if step is None else step.gate_of(thread)
            if gate is not None:
                task, producers = gate
                activity = ("waiting for", "', '".join(producers), task, step.index + self._lookahead[task])
            text = _format_activity(activity)
            if activity[0] != "idle" and worker.ident in frames:
                text += "\n" + _stack_of(worker)
            report[thread] = text
        return report


def _name_of(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _describe_source(batches: Iterable[Any]) -> str:
    name = getattr(batches, "__qualname__", None)  # a generator: its function
    return f"generator {name}" if name else type(batches).__name__


def _format_activity(activity: tuple) -> str:
    if activity[0] == "running":
        return f"running task '{activity[1]}' on batch {activity[2]}"
    if activity[0] == "idle":
        return "idle (no task of this step left)"
    what, producer, task, batch = activity
    return f"{what} '{producer}' before task '{task}' on batch {batch}"
