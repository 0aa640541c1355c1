"""Errors the engine raises in the caller's thread."""


class EngineError(RuntimeError):
    """The engine cannot go on (it was closed, or a step failed before)."""


class TaskError(EngineError):
    """A task body raised. The message names the task, the batch, the step and the thread; the original
    exception is chained as ``__cause__``."""

    def __init__(self, task: str, batch: int, step: int, thread: str, cause: BaseException):
        self.task, self.batch, self.step, self.thread = task, batch, step, thread
        super().__init__(f"task '{task}' failed on batch {batch} (step {step}, thread '{thread}'): "
                         f"{type(cause).__name__}: {cause}")


class StepTimeout(EngineError):
    """A step did not finish in time. ``activity`` says what each thread was doing, with its stack."""

    def __init__(self, step: int, timeout: float, activity: dict[str, str], headline: str | None = None):
        self.step, self.timeout, self.activity = step, timeout, activity
        lines = [headline or f"step {step} did not finish within {timeout:g} s; what each thread was doing:"]
        lines += [f"  thread '{thread}': {what}" for thread, what in activity.items()]
        super().__init__("\n".join(lines))


class LoaderTimeout(StepTimeout):
    """The data loader gave no batch in time. ``source`` names the loader; ``activity`` holds the stack of
    the thread that was pulling from it."""

    def __init__(self, step: int, batch: int, timeout: float, source: str, activity: dict[str, str]):
        self.batch, self.source = batch, source
        super().__init__(step, timeout, activity,
                         f"the data loader ({source}) gave no batch within {timeout:g} s: batch {batch}, due for "
                         f"step {step}; what the thread pulling from it was doing:")


class SlotError(EngineError):
    """A task body read or wrote a slot it did not declare, or read one before it was written."""
