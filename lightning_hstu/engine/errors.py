"""Errors the engine raises in the caller's thread."""


class EngineError(RuntimeError):
    """The engine cannot go on (it was closed, or a step failed before)."""


class TaskError(EngineError):
    """A task body raised. The message names the task, the batch, the step and the thread; the original
    exception is chained as ``__cause__``."""

    def __init__(self, task: str, batch: int, step: int, thread: str, cause: BaseException):
        self.task, self.batch, self.step, self.thread = task, batch, step, thread
        super().__init__(
            f"task '{task}' failed on batch {batch} (step {step}, thread '{thread}'): {type(cause).__name__}: {cause}"
        )


class StepTimeout(EngineError):
    """A step did not finish in time. ``activity`` says what each thread was doing, with its stack;
    ``collectives`` lists the collectives this process issued that have not completed (None: not known,
    a single process); ``rank`` names the process in a distributed job (None: a single process)."""

    def __init__(
        self,
        step: int,
        timeout: float,
        activity: dict[str, str],
        headline: str | None = None,
        *,
        rank: int | None = None,
        collectives: list[str] | None = None,
    ):
        self.step, self.timeout, self.activity = step, timeout, activity
        self.rank, self.collectives = rank, collectives
        headline = headline or f"step {step} did not finish within {timeout:g} s; what each thread was doing:"
        lines = [headline if rank is None else f"rank {rank}: {headline}"]
        lines += [f"  thread '{thread}': {what}" for thread, what in activity.items()]
        if collectives is not None:
            issuer = "this process" if rank is None else "this rank"
            lines.append(f"collectives {issuer} issued that have not completed:" + ("" if collectives else " none"))
            lines += [f"  {line}" for line in collectives]
        super().__init__("\n".join(lines))


class LoaderTimeout(StepTimeout):
    """The data loader gave no batch in time. ``source`` names the loader; the ``activity`` of thread
    ``loader`` is the stack of the pull (the ranks' agreement on the end of data is part of it)."""

    def __init__(self, step: int, batch: int, timeout: float, source: str, activity: dict[str, str], **details):
        self.batch, self.source = batch, source
        super().__init__(
            step,
            timeout,
            activity,
            f"the data loader ({source}) gave no batch within {timeout:g} s: batch {batch}, due for "
            f"step {step}; what each thread was doing:",
            **details,
        )


class CallerTimeout(StepTimeout):
    """The caller's own work around a step (Lightning's hooks before or after it) did not return in time.
    The caller is the stuck thread, so this is printed by the watchdog rather than raised (or raised only
    when that work returns at last)."""

    def __init__(self, step: int, timeout: float, what: str, activity: dict[str, str], **details):
        self.what = what
        super().__init__(
            step,
            timeout,
            activity,
            f"the caller's thread did not return from {what} within {timeout:g} s (step {step}); "
            f"what each thread was doing:",
            **details,
        )


class PeerFailure(StepTimeout):
    """Another rank of the job failed, so this rank's step cannot finish (its collectives wait for that rank).
    ``failure`` is the other rank's own account (its rank and error), read from the process group's store;
    ``activity`` and ``collectives`` are this rank's, as a timeout's."""

    def __init__(self, step: int, timeout: float, failure: str, activity: dict[str, str], **details):
        self.failure = failure
        super().__init__(
            step, timeout, activity, f"step {step} cannot finish: {failure}; what each thread was doing:", **details
        )


class SlotError(EngineError):
    """A task body read or wrote a slot it did not declare, or read one before it was written."""
