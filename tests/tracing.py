"""A deterministic workload for engine tests: every task body records when it ran and writes values
derived from what it read, and the stateful tasks update a tiny "model" the way training does
(zero_grad clears grads, backward accumulates them, optimizer_step changes the weights that
compute_output_dist and forward read). Two runs agree only if every task saw the same inputs and the
same model state on every batch."""

import itertools
import random
import threading
import time
import zlib
from dataclasses import dataclass, field

from lightning_hstu import Plan


def digest(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


@dataclass(frozen=True)
class Run:
    task: str
    batch: int
    step: int
    thread: str
    begin: int
    """Position in the global order of begin/end events."""
    end: int


@dataclass
class TracingWorkload:
    plan: Plan
    max_delay_s: float = 0.0
    """Sleep a random time up to this in every body, to shake the interleaving of threads."""
    seed: int = 0
    runs: list[Run] = field(default_factory=list)
    outputs: dict[tuple[str, int], int] = field(default_factory=dict)
    weights: int = 0
    grads: int = 0

    def __post_init__(self):
        self._clock = itertools.count()
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()

    def bodies(self):
        return {t.name: self._body(t.name) for t in self.plan.tasks}

    def _body(self, name):
        task = self.plan.task(name)

        def body(batch):
            begin = next(self._clock)
            if self.max_delay_s:
                with self._lock:
                    delay = self._rng.uniform(0, self.max_delay_s)
                time.sleep(delay)
            value = digest(name, batch.index, [batch[slot] for slot in task.reads], self._model_input(name))
            self._update_model(name, value)
            for slot in task.writes:
                batch[slot] = value
            self.outputs[(name, batch.index)] = value
            self.runs.append(
                Run(name, batch.index, batch.step, threading.current_thread().name, begin, next(self._clock))
            )

        return body

    def _model_input(self, name):
        if name in ("compute_output_dist", "forward"):
            return self.weights
        if name == "finalize_model_grads":
            return self.grads
        return None

    def _update_model(self, name, value):
        if name == "zero_grad":
            self.grads = 0
        elif name == "backward":
            self.grads = digest(self.grads, value)
        elif name == "optimizer_step":
            self.weights = digest(self.weights, value)
