"""The step watchdog: one thread (``hstu-watchdog``) that times every blocking point of a step.

The caller opens a *watch* around each thing it waits for or runs itself: the pull of a batch (which the
loader thread performs, ranks' agreement on the end of data included), the step (every task body on every
engine thread, up to the step barrier), and its own work around the step (Lightning's hooks, which may
host-synchronise or run a collective). Each watch has the step timeout as its deadline. When one expires,
the watchdog builds the report (every thread's activity and stack, the collectives in flight) while the
threads are still where they hang, and then:

- if the caller is waiting with a poll (the pull, the step barrier), the caller raises the report;
- if the caller is itself the thread that is stuck, nobody else can: the watchdog prints the report.

In a distributed job the watchdog also ends a step that cannot finish because another rank failed
(``TimeoutActions.peer_failure``, read about once a second while a watch is open): the same report and
actions as a timeout, at once, naming the other rank's error (``PeerFailure``), where the step would
otherwise wait in a collective for the failed rank until the timeout.

A process that must not outlive its timeout (a rank of a distributed job) gets ``TimeoutActions`` with
``end_process``: its process groups are aborted once the report is out, and it ends with exit code
``WATCHDOG_EXIT_CODE``, at once when the caller is stuck, else when it exits or at the latest ``grace``
seconds after the timeout. Without it (one process, the engine on its own) the watchdog only reports.
"""

import atexit
import contextlib
import itertools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from time import monotonic, sleep
from typing import Any, NamedTuple

from .errors import PeerFailure, StepTimeout

POLL_S = 0.25
"""How often the watchdog checks its deadlines, and a waiting caller checks for a timeout or a KeyboardInterrupt."""

WATCHDOG_EXIT_CODE = 124
"""The exit status of a process the watchdog ended (as ``timeout(1)`` exits when its command timed out)."""

PEER_CHECK_S = 1.0
"""How often, while a watch is open, the watchdog asks whether another rank failed (``peer_failure``)."""

_ABORT_WAIT_S = 2.0
"""How long the watchdog waits for the process groups' abort, or for the collectives' report, before it
goes on without them (an abort or a dump can itself block on a communicator that hangs)."""


class WatchKind(StrEnum):
    LOADER = "loader"
    """The caller waits for the loader thread's pull of one batch."""
    STEP = "step"
    """The caller waits for the step barrier (every task body of every engine thread)."""
    CALLER = "caller"
    """The caller's own work around a step; if it hangs, the caller cannot raise anything."""


class Watch(NamedTuple):
    """One deadline. (A named tuple: a few are made per step, on the hot path.)"""

    kind: WatchKind
    step: int
    what: str
    """What the caller is doing, for the report: ``waiting for the step barrier of step 7``."""
    thread: threading.Thread
    """The caller: the thread that opened the watch."""
    deadline: float
    batch: int | None = None
    """The batch being pulled (``WatchKind.LOADER``)."""
    source: str | None = None
    """The loader, named (``WatchKind.LOADER``)."""

    @property
    def caller_raises(self) -> bool:
        return self.kind != WatchKind.CALLER


@dataclass(frozen=True)
class TimeoutActions:
    """What a timed-out process does besides reporting; given by whoever owns the process (the strategy).
    The default only reports: the engine on its own, or a single process."""

    rank: int | None = None
    """This process's rank, named in the report (None: a single process)."""
    collectives_in_flight: Callable[[], list[str] | None] | None = None
    """The collectives this process issued that have not completed, one line each, for the report (None:
    nothing to ask)."""
    abort: Callable[[], None] | None = None
    """Abort the process groups, so that threads blocked in a collective that can be aborted fail instead
    of waiting for the process groups' own timeout. Called once the report is out."""
    end_process: bool = False
    """End the process after a timeout (``os._exit(WATCHDOG_EXIT_CODE)``): at once when the caller is the
    stuck thread, when the interpreter exits, and at the latest ``grace`` seconds after the timeout."""
    before_exit: Callable[[], None] | None = None
    """Run once before the process ends after a timeout (the launching rank ends the ranks it started)."""
    grace: float = 3.0
    """Seconds the caller has, after the timeout, to raise the report and let the process exit by itself."""
    peer_failure: Callable[[], str | None] | None = None
    """Another rank's failure, in its own words, once one was reported (None: none yet). Asked every
    ``PEER_CHECK_S`` while a watch is open, and at most ``_ABORT_WAIT_S`` waited for; a failure found ends
    the open watches as a timeout does (``PeerFailure``). None: nothing to ask (a single process)."""


@dataclass
class _Expiry:
    error: StepTimeout
    watch: Watch
    picked_up: threading.Event = field(default_factory=threading.Event)


class Watchdog:
    """Deadlines for the caller's watches, and what happens when one passes. ``report(watch, failure)`` builds
    the ``StepTimeout`` for an expired watch, or the ``PeerFailure`` where another rank's ``failure`` ended it
    (it runs on the watchdog thread, while the others still hang)."""

    def __init__(self, timeout: float, report: Callable[[Watch, str | None], StepTimeout], actions: TimeoutActions):
        self.timeout = timeout
        self.actions = actions
        self._report = report
        self._watches: dict[int, Watch] = {}
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._expiry: _Expiry | None = None
        self._exit_lock = threading.Lock()
        self._aborted = self._ending = False
        self._asking_peers = actions.peer_failure is not None
        self.thread = threading.Thread(target=self._run, name="hstu-watchdog", daemon=True)

    @property
    def expired(self) -> StepTimeout | None:
        """The report of the watch that expired (None while none has); the engine cannot go on after one."""
        return None if self._expiry is None else self._expiry.error

    def start(self) -> "Watchdog":
        self.thread.start()
        return self

    def close(self) -> None:
        """Stop watching. After a timeout with ``end_process`` the thread goes on: it ends the process."""
        self._stopping.set()
        if self._expiry is not None:
            self._expiry.picked_up.set()  # whatever the caller raised instead, it is out
        if self._expiry is None or not self.actions.end_process:
            self.thread.join()

    def watch(self, kind: WatchKind, step: int, what: str, **details: Any) -> "_Watching":
        """Time the block with the step timeout. A timeout reported meanwhile is raised when it ends."""
        return _Watching(
            self, Watch(kind, step, what, threading.current_thread(), monotonic() + self.timeout, **details)
        )

    def _open(self, watch: Watch) -> int:
        key = next(self._keys)
        with self._lock:
            self._watches[key] = watch
        return key

    def _close(self, key: int, raised: BaseException | None) -> None:
        with self._lock:
            self._watches.pop(key, None)
        if self._expiry is not None and raised is not self._expiry.error:
            # the root cause; what the block raised (an aborted collective) follows from it
            self.raise_expired()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No deadline runs in the block (work that may take longer than a step, such as writing a
        checkpoint); the watches open around it start over with a full timeout when it ends."""
        with self._lock:
            held, self._watches = self._watches, {}
        try:
            yield
        finally:
            now = monotonic()
            with self._lock:
                for key, watch in held.items():
                    self._watches[key] = watch._replace(deadline=now + self.timeout)

    def raise_expired(self) -> None:
        """Raise the timeout's report, if there is one (on the caller's thread)."""
        expiry = self._expiry
        if expiry is not None:
            expiry.picked_up.set()
            raise expiry.error

    # ----- the watchdog thread ----------------------------------------------------------------------

    def _run(self) -> None:
        next_check = monotonic() + PEER_CHECK_S
        while not self._stopping.wait(POLL_S):
            now = monotonic()
            with self._lock:
                watches = list(self._watches.values())
            due = [w for w in watches if w.deadline <= now]
            if due:
                self._expire(min(due, key=lambda w: w.deadline))
                return
            if watches and self._asking_peers and now >= next_check:
                failure = self._ask_peers()
                next_check = monotonic() + PEER_CHECK_S
                with self._lock:
                    watches = list(self._watches.values())
                if failure and watches:
                    self._expire(min(watches, key=lambda w: w.deadline), failure)
                    return

    def _ask_peers(self) -> str | None:
        """``peer_failure()``, waited for at most ``_ABORT_WAIT_S``. One that raises or does not answer in time
        (the store's host ended, after a failure or a finished run alike, or hangs) is not asked again, and
        says nothing: the step timeout still bounds the step."""
        answer: list = []

        def ask() -> None:
            try:
                answer.append(self.actions.peer_failure())
            except Exception:
                pass

        asking = threading.Thread(target=ask, name="hstu-watchdog-peers", daemon=True)
        asking.start()
        asking.join(_ABORT_WAIT_S)
        if not answer:
            self._asking_peers = False
            return None
        return answer[0]

    def _expire(self, watch: Watch, failure: str | None = None) -> None:
        expired_at = monotonic()
        try:
            error = self._report(watch, failure)
        except BaseException as exc:  # a report that fails must not keep the process from ending
            headline = f"step {watch.step}: the watchdog could not build its report ({exc!r})"
            activity = {"caller": watch.what}
            error = (
                StepTimeout(watch.step, self.timeout, activity, headline)
                if failure is None
                else PeerFailure(watch.step, self.timeout, f"{failure} ({headline})", activity)
            )
        expiry = self._expiry = _Expiry(error, watch)
        actions = self.actions
        if actions.end_process:
            # Whichever way the process ends from here, it ends like this: an abort may unblock the caller,
            # whose exit would otherwise end this (daemon) thread before it ends the launched ranks.
            atexit.register(self._end_process)
        if watch.caller_raises:
            expiry.picked_up.wait(4 * POLL_S)  # the report is out (raised) before anything is aborted
            self._abort()
            if not actions.end_process:
                return
            sleep(max(0.0, expired_at + actions.grace - monotonic()))  # the process may end by itself meanwhile
            if not self._ending:
                if watch.thread.is_alive():  # the raised report has not reached the top: say it here
                    _print(f"{type(error).__name__}: {error}")
                _print(f"{self._rank}the process did not end within {actions.grace:g} s of {self._cause}")
        else:
            _print(f"{type(error).__name__}: {error}")
            self._abort()
            if not actions.end_process:
                return
            where = "is in its own work around the step" if isinstance(error, PeerFailure) else "is the one that hangs"
            _print(f"{self._rank}the caller's thread {where}: nothing can be raised there")
        self._end_process()

    @property
    def _cause(self) -> str:
        peer = self._expiry is not None and isinstance(self._expiry.error, PeerFailure)
        return "another rank's failure" if peer else "its step timeout"

    @property
    def _rank(self) -> str:
        return "" if self.actions.rank is None else f"rank {self.actions.rank}: "

    def _abort(self) -> None:
        """The process groups' abort, once, waiting for it at most ``_ABORT_WAIT_S``."""
        with self._exit_lock:
            if self._aborted or self.actions.abort is None:
                return
            self._aborted = True
        call_bounded(self.actions.abort, "aborting the process groups")

    def _end_process(self) -> None:
        self._ending = True
        self._abort()
        with self._exit_lock:  # whether from the interpreter's exit or from this thread: the first ends it
            if self.actions.before_exit is not None:
                try:
                    self.actions.before_exit()
                except BaseException as exc:
                    _print(f"ending the process: {exc!r}")
            _print(f"{self._rank}ending the process after {self._cause} (exit code {WATCHDOG_EXIT_CODE})")
            sys.stdout.flush()
            os._exit(WATCHDOG_EXIT_CODE)


class _Watching:
    """The context of ``Watchdog.watch`` (a class, not a generator: it is entered a few times per step)."""

    __slots__ = ("_watchdog", "_watch", "_key")

    def __init__(self, watchdog: Watchdog, watch: Watch):
        self._watchdog, self._watch = watchdog, watch

    def __enter__(self) -> Watch:
        self._key = self._watchdog._open(self._watch)
        return self._watch

    def __exit__(self, kind: Any, raised: BaseException | None, traceback: Any) -> None:
        self._watchdog._close(self._key, raised)


def _print(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def call_bounded(fn: Callable[[], Any], what: str, seconds: float = _ABORT_WAIT_S) -> Any:
    """``fn()`` on a thread of its own, waited for at most ``seconds``; None if it raised (said on stderr) or
    did not answer in time. An abort or a flight-recorder dump can itself block on a communicator that
    hangs: the watchdog must go on without it."""
    result: list = []

    def call() -> None:
        try:
            result.append(fn())
        except BaseException as exc:
            _print(f"{what} failed: {exc!r}")

    runner = threading.Thread(target=call, name="hstu-watchdog-call", daemon=True)
    try:
        runner.start()
    except RuntimeError:  # the interpreter is shutting down (Python >= 3.12 starts no thread then)
        call()
        return result[0] if result else None
    runner.join(seconds)
    if runner.is_alive():
        _print(f"{what}: no answer within {seconds:g} s; going on without it")
    return result[0] if result else None
