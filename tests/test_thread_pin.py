"""HSTUPipelineStrategy(pin_threads=...): the training batches' threads on one core, everything else (the
first batch of an epoch, validation, what follows fit, a failed fit) on the cores it had."""

import os
import threading

import pytest
from lightning.pytorch.callbacks import Callback

from lightning_runs import fit

from lightning_hstu import HSTUPipelineStrategy
from lightning_hstu.engine.affinity import core_for
from lightning_hstu.models.toy import ToyRecommender

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and two cores to tell a pinned thread from an unpinned one",
)
ALL = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
CORE = max(ALL, default=0)


def this_threads_cores() -> set[int]:
    return os.sched_getaffinity(0)  # on Linux, 0 is the calling thread


class CoreProbe(ToyRecommender):
    """Records the cores of the thread running each training and validation step; fails at ``fail_at``."""

    def __init__(self, fail_at: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.fail_at = fail_at
        self.step_cores: list[tuple[int, int, set[int]]] = []
        self.validation_cores: list[set[int]] = []

    def training_step(self, batch, batch_idx):
        self.step_cores.append((self.current_epoch, batch_idx, this_threads_cores()))
        if batch_idx == self.fail_at:
            raise RuntimeError("a failing step")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.validation_cores.append(this_threads_cores())
        return super().validation_step(batch, batch_idx)


class CallerCores(Callback):
    def __init__(self):
        self.batch_end: list[tuple[int, set[int]]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batch_end.append((batch_idx, this_threads_cores()))


@pytest.mark.parametrize("preset", ["legacy_none", "default_d6"])
def test_training_batches_run_on_the_core_and_validation_and_the_caller_keep_theirs(preset):
    caller = CallerCores()
    model, _ = fit(
        HSTUPipelineStrategy(preset, pin_threads=CORE),
        model_cls=CoreProbe,
        max_epochs=2,
        val_check_interval=0.5,  # validation after batches 5 and 11 of the 12
        callbacks=[caller],
    )
    # pinned from the end of an epoch's first batch, released for validation, pinned again after the next batch
    unpinned = {(epoch, batch) for epoch in (0, 1) for batch in (0, 6)}
    assert [(e, b) for e, b, cores in model.step_cores if cores == ALL] == sorted(unpinned)
    assert all(cores == {CORE} for e, b, cores in model.step_cores if (e, b) not in unpinned)
    assert len(model.step_cores) == 24
    assert model.validation_cores and all(cores == ALL for cores in model.validation_cores)
    # the caller's thread runs the batch hooks: on the core once its epoch's first batch ended
    assert [cores for b, cores in caller.batch_end if b in (0, 6)] == [ALL] * 4
    assert all(cores == {CORE} for b, cores in caller.batch_end if b not in (0, 6))
    assert this_threads_cores() == ALL


def test_a_failed_fit_gives_the_caller_its_cores_back():
    with pytest.raises(Exception, match="a failing step"):
        fit(HSTUPipelineStrategy("legacy_none", pin_threads=CORE), model_cls=CoreProbe, model_kwargs={"fail_at": 4})
    assert this_threads_cores() == ALL
    assert threading.current_thread() is threading.main_thread()


def test_a_core_this_process_may_not_use_is_refused_before_any_step():
    model = None

    class Made(CoreProbe):
        def __init__(self, **kwargs):
            nonlocal model
            super().__init__(**kwargs)
            model = self

    with pytest.raises(ValueError, match=rf"core 100000 is not among the cores this process may run on: \[.*{CORE}\]"):
        fit(HSTUPipelineStrategy(pin_threads=100_000), model_cls=Made)
    assert model.step_cores == []


@pytest.mark.parametrize("value", ["0", True, -1, [], [0, "1"], 1.0])
def test_pin_threads_that_is_not_a_core_or_a_list_of_cores_is_refused(value):
    with pytest.raises(ValueError, match="pin_threads must be None, a CPU core"):
        HSTUPipelineStrategy(pin_threads=value)


def test_pin_threads_needs_the_engine():
    with pytest.raises(ValueError, match="pin_threads needs engine=True"):
        HSTUPipelineStrategy(engine=False, pin_threads=0)


def test_each_process_of_a_machine_takes_its_own_core():
    assert core_for([min(ALL), CORE], local_rank=1, local_processes=2) == CORE
    with pytest.raises(ValueError, match="would put the 2 processes of this machine on one core"):
        core_for(CORE, local_rank=0, local_processes=2)
    with pytest.raises(ValueError, match=r"names 1 core\(s\) for the 2 processes"):
        core_for([CORE], local_rank=1, local_processes=2)
