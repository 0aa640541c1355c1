"""The step watchdog in one process (docs/watchdog.md): the caller's own work around a step is timed like
the step; a timeout the caller cannot raise (it is the stuck thread) is printed at the deadline and raised
once the caller returns; writing a checkpoint is not timed; the report lists every thread and the
collective tasks that have not returned. Two processes: test_watchdog_ranks.py."""

import datetime
import threading
import time

import pytest
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from conftest import engine_threads
from lightning_runs import fit
from tracing import TracingWorkload

from lightning_hstu import Engine, HSTUPipelineStrategy, StepTimeout, get_plan
from lightning_hstu.engine import CallerTimeout, PeerFailure, TimeoutActions

STALL_S = 1.5  # how long a stalled hook blocks; far above the timeout below, far below a hang
TIMEOUT_S = 0.5


@pytest.mark.usefixtures("no_thread_left")
def test_a_caller_stuck_before_a_step_is_printed_at_the_deadline_and_raised_when_it_returns(capfd):
    plan = get_plan("default_d3")
    printed_while_stuck = []

    def before_step(index):
        if index == 4:
            time.sleep(STALL_S)
            printed_while_stuck.append(capfd.readouterr().err)  # before this function returned
        return True

    engine = Engine(plan, TracingWorkload(plan).bodies(), step_timeout=TIMEOUT_S).start()
    with pytest.raises(CallerTimeout) as info:
        list(engine.steps(range(10), before_step))
    message = str(info.value)
    assert f"the caller's thread did not return from before_step(4) ({before_step.__qualname__}) within" in message
    assert "thread 'caller': before_step(4)" in message and "time.sleep(STALL_S)" in message  # its stack
    assert "thread 'loader': idle" in message and "thread 'compute': idle" in message
    assert isinstance(info.value, StepTimeout)  # caught like any other timeout
    assert f"CallerTimeout: {message}" in printed_while_stuck[0]
    assert engine_threads() == []


@pytest.mark.usefixtures("no_thread_left")
def test_a_hung_collective_task_is_listed_among_the_collectives_in_flight():
    plan = get_plan("per_task_d3")
    bodies = TracingWorkload(plan).bodies()
    bodies["global_tokens_allreduce"] = lambda batch, normal=bodies["global_tokens_allreduce"]: (
        time.sleep(STALL_S) if batch.index == 2 else None,
        normal(batch),
    )
    engine = Engine(plan, bodies, step_timeout=TIMEOUT_S).start()
    with pytest.raises(StepTimeout) as info:
        engine.run(range(6))
    assert info.value.collectives == [
        "engine: task 'global_tokens_allreduce' on batch 2 (thread "
        "'global_tokens_allreduce') launches collectives and has not returned"
    ]
    assert "collectives this process issued that have not completed:" in str(info.value)


@pytest.mark.usefixtures("no_thread_left")
def test_another_ranks_failure_ends_a_waiting_step_with_that_ranks_error_before_the_timeout():
    """``TimeoutActions.peer_failure`` (the strategy reads the process group's store): a step that waits for a
    rank that failed ends with ``PeerFailure`` naming that rank's error once it is noted, not at the step
    timeout; before anything is noted the steps run as usual."""
    plan = get_plan("default_d3")
    bodies = TracingWorkload(plan).bodies()
    release = threading.Event()
    noted: list[str] = []

    def forward(batch, normal=bodies["forward"]):
        if batch.index == 3:  # waits in a collective for the failed rank, which never comes
            noted.append("rank 1 failed: TaskError: task 'forward' failed on batch 3: ValueError: bad batch")
            release.wait(60)
        return normal(batch)

    bodies["forward"] = forward

    def peer_failure():
        if not noted:
            return None
        threading.Timer(0.5, release.set).start()  # the collective fails once this rank gives up (an abort)
        return noted[0]

    engine = Engine(plan, bodies, step_timeout=600, on_timeout=TimeoutActions(peer_failure=peer_failure)).start()
    try:
        with pytest.raises(PeerFailure) as info:  # the 600 s timeout would raise a StepTimeout of its own
            engine.run(range(6))
    finally:
        release.set()
        engine.close()
    message = str(info.value)
    assert message.startswith("step 3 cannot finish: rank 1 failed: TaskError: task 'forward' failed on batch 3")
    assert "thread 'compute': running task 'forward' on batch 3" in message  # this rank's own threads
    assert info.value.failure == noted[0] and isinstance(info.value, StepTimeout)


class SlowCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, *args, **kwargs):
        time.sleep(STALL_S)
        super().save_checkpoint(*args, **kwargs)


@pytest.mark.usefixtures("no_thread_left")
def test_writing_a_checkpoint_is_not_timed_but_the_end_of_a_batch_is(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    _, trainer = fit(
        HSTUPipelineStrategy("default_d6", step_timeout=TIMEOUT_S, checkpoint_io=SlowCheckpointIO()),
        max_steps=4,
        callbacks=[checkpoint],
        enable_checkpointing=True,
    )
    assert trainer.global_step == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=2.ckpt", "step=4.ckpt"]

    class StallsAtTheEndOfBatch3(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 3:
                time.sleep(STALL_S)

    with pytest.raises(CallerTimeout) as info:
        fit(HSTUPipelineStrategy("default_d6", step_timeout=TIMEOUT_S), callbacks=[StallsAtTheEndOfBatch3()])
    assert "did not return from the end of batch 3 (on_train_batch_end hooks, logging)" in str(info.value)
    assert "in on_train_batch_end" in str(info.value)


def test_the_process_groups_time_out_after_the_step_timeout_unless_told():
    assert HSTUPipelineStrategy(step_timeout=20).process_group_timeout == datetime.timedelta(seconds=2 * 20 + 60)
    told = datetime.timedelta(minutes=45)
    assert HSTUPipelineStrategy(step_timeout=20, timeout=told).process_group_timeout == told
    assert HSTUPipelineStrategy(step_timeout=None).process_group_timeout == datetime.timedelta(
        minutes=30
    )  # Lightning's
