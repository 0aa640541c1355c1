"""The step's Python threads on one CPU core (Linux): ``HSTUPipelineStrategy(pin_threads=...)``.

The caller's thread, the engine's workers and its loader thread take turns holding the GIL; when the
operating system runs them on different cores, each hand-off moves the interpreter's working set from one
core's caches to another's. On one core they hand over within its caches (measured in BENCHMARKS.md, "The
step's threads on one core"). Meant for GPU training, where these threads launch work and run Python, which
the GIL serialises anyway; on a CPU device the step's compute runs on them too.
"""

import contextlib
import os
import threading
from collections.abc import Iterable, Sequence

from ..plan import PlanError


def check_pin_threads(value: object) -> int | tuple[int, ...] | None:
    """``pin_threads`` as given to the strategy: None, a core, or one core per process of a machine (local
    rank ``i`` takes the ``i``-th); anything else raises ``PlanError`` (a ``ValueError``) naming it."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and value
        and all(isinstance(core, int) and not isinstance(core, bool) and core >= 0 for core in value)
    ):
        return tuple(value)
    raise PlanError(
        f"pin_threads must be None, a CPU core (an int >= 0) or a list of cores, one per process of a machine; "
        f"got {value!r}"
    )


def core_for(pin_threads: int | tuple[int, ...], local_rank: int, local_processes: int) -> int:
    """The core of the process of local rank ``local_rank`` among ``local_processes`` on its machine, checked
    against the cores this process may run on."""
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("pin_threads needs os.sched_setaffinity, which this platform (not Linux) does not have")
    if isinstance(pin_threads, int):
        if local_processes > 1:
            raise ValueError(
                f"pin_threads={pin_threads} would put the {local_processes} processes of this machine on one core; "
                f"give one core per process, e.g. pin_threads={list(range(0, 8 * local_processes, 8))}"
            )
        core = pin_threads
    elif len(pin_threads) < local_processes:
        raise ValueError(
            f"pin_threads={list(pin_threads)} names {len(pin_threads)} core(s) for the {local_processes} processes "
            f"of this machine; give one per process"
        )
    else:
        core = pin_threads[local_rank]
    allowed = os.sched_getaffinity(0)
    if core not in allowed:
        raise ValueError(f"pin_threads: core {core} is not among the cores this process may run on: {sorted(allowed)}")
    return core


class ThreadPin:
    """Moves threads to one core and back: ``pin`` records each thread's set of cores and gives it ``{core}``;
    ``release`` gives every thread it pinned, if still alive, its set back."""

    def __init__(self, core: int):
        self.core = core
        self._saved: dict[threading.Thread, set[int]] = {}

    @property
    def pinned(self) -> bool:
        return bool(self._saved)

    def pin(self, threads: Iterable[threading.Thread]) -> None:
        for thread in threads:
            if thread in self._saved or not thread.is_alive() or thread.native_id is None:
                continue
            self._saved[thread] = os.sched_getaffinity(thread.native_id)
            os.sched_setaffinity(thread.native_id, {self.core})

    def release(self) -> None:
        saved, self._saved = self._saved, {}
        for thread, cores in saved.items():
            if thread.is_alive():
                with contextlib.suppress(ProcessLookupError):  # ended since is_alive()
                    os.sched_setaffinity(thread.native_id, cores)


__all__ = ["ThreadPin", "check_pin_threads", "core_for"]
