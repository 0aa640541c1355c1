"""A task that raises, a step that hangs, an interrupt: clear errors, and no engine thread left."""

import _thread
import signal
import threading
import time

import pytest

from conftest import engine_threads
from tracing import TracingWorkload

from lightning_hstu import PRESET_NAMES, Engine, EngineError, StepTimeout, TaskError, get_plan
from lightning_hstu.engine import SlotError


def bodies_with(plan, **overrides):
    """The tracing bodies, with some wrapped: an override runs first, then the task's normal body."""
    bodies = TracingWorkload(plan).bodies()
    for name, before in overrides.items():
        bodies[name] = lambda batch, before=before, normal=bodies[name]: (before(batch), normal(batch))
    return bodies


def failing_at(batch_index, exc):
    def body(batch):
        if batch.index == batch_index:
            raise exc

    return body


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_a_failing_forward_names_task_batch_and_thread(name):
    plan = get_plan(name)
    engine = Engine(plan, bodies_with(plan, forward=failing_at(7, ValueError("bad logits")))).start()
    with pytest.raises(TaskError) as info:
        engine.run(range(12))
    error = info.value
    thread = plan.task("forward").thread
    assert (error.task, error.batch, error.step, error.thread) == ("forward", 7, 7, thread)
    assert f"task 'forward' failed on batch 7 (step 7, thread '{thread}'): ValueError: bad logits" in str(error)
    assert isinstance(error.__cause__, ValueError)
    assert engine_threads() == []  # closed by the failure itself, before the caller does anything
    with pytest.raises(EngineError, match="closed"):
        engine.run(range(2))


@pytest.mark.usefixtures("no_thread_left")
def test_a_failing_producer_does_not_hang_its_waiting_consumer():
    plan = get_plan("default_d6")  # start_input_dist (compute) waits for finish_shuffle (io)
    started = threading.Event()

    def slow_finish_shuffle(batch):
        started.wait(1.0)
        raise RuntimeError("all-gather failed")

    def start_input_dist(batch):
        started.set()

    with Engine(
        plan, bodies_with(plan, finish_shuffle=slow_finish_shuffle, start_input_dist=start_input_dist), step_timeout=30
    ) as engine:
        with pytest.raises(TaskError, match="task 'finish_shuffle' failed on batch 0 .*thread 'io'"):
            engine.run(range(8))


@pytest.mark.usefixtures("no_thread_left")
def test_the_root_cause_is_kept_when_later_tasks_fail_too():
    plan = get_plan("per_task_d3")

    def forward(batch):
        raise KeyError("first")

    def finalize_model_grads(batch):  # runs only if a waiter goes on after the abort
        raise AssertionError("secondary")

    with Engine(plan, bodies_with(plan, forward=forward, finalize_model_grads=finalize_model_grads)) as engine:
        with pytest.raises(TaskError) as info:
            engine.run(range(4))
    assert info.value.task == "forward"
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.usefixtures("no_thread_left")
def test_a_hung_step_is_reported_with_what_each_thread_was_doing():
    plan = get_plan("default_d6")

    def stuck_in_all_gather(batch):
        if batch.index == 4:
            time.sleep(1.0)

    engine = Engine(plan, bodies_with(plan, finish_shuffle=stuck_in_all_gather), step_timeout=0.3).start()
    with pytest.raises(StepTimeout) as info:
        engine.run(range(10))
    message = str(info.value)
    assert "step 1 did not finish within 0.3 s" in message  # batch 4 at lookahead 3
    assert "thread 'io': running task 'finish_shuffle' on batch 4" in message
    assert "in stuck_in_all_gather" in message  # the Python stack of the stuck thread
    assert "thread 'compute': waiting for 'finish_shuffle' before task 'start_input_dist' on batch 4" in message
    assert engine_threads() == []


@pytest.mark.usefixtures("no_thread_left")
def test_keyboard_interrupt_joins_every_thread():
    plan = get_plan("full_split_d6")

    def forward(batch):
        if batch.index == 2:
            _thread.interrupt_main()  # as if the user pressed Ctrl-C now
            time.sleep(0.2)

    # Python's own Ctrl-C handler, also where the suite was started with SIGINT ignored (a shell's background
    # job): interrupt_main() does nothing then
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with Engine(plan, bodies_with(plan, forward=forward)) as engine:
                engine.run(range(10))
    finally:
        signal.signal(signal.SIGINT, handler)


@pytest.mark.usefixtures("no_thread_left")
def test_keyboard_interrupt_raised_in_a_worker_reaches_the_caller_as_such():
    plan = get_plan("default_d3")
    with pytest.raises(KeyboardInterrupt):
        with Engine(plan, bodies_with(plan, backward=failing_at(1, KeyboardInterrupt()))) as engine:
            engine.run(range(5))


@pytest.mark.usefixtures("no_thread_left")
def test_a_failing_data_iterator_raises_its_own_error():
    def batches():
        yield from range(3)
        raise OSError("shard unreadable")

    plan = get_plan("default_d3")
    engine = Engine(plan, bodies_with(plan)).start()
    with pytest.raises(OSError, match="shard unreadable"):
        engine.run(batches())
    assert engine_threads() == []


@pytest.mark.usefixtures("no_thread_left")
def test_reading_an_undeclared_slot_is_a_task_error():
    plan = get_plan("default_d3")

    def forward(batch):
        return batch["grads"]  # forward does not read grads

    with Engine(plan, bodies_with(plan, forward=forward)) as engine:
        with pytest.raises(TaskError, match="forward") as info:
            engine.run(range(3))
    assert isinstance(info.value.__cause__, SlotError)
    assert "reads slot 'grads' it did not declare" in str(info.value)


def test_a_failure_in_the_legacy_plan_names_the_main_thread():
    plan = get_plan("legacy_none")
    with Engine(plan, bodies_with(plan, watchdog=failing_at(3, FloatingPointError("loss is nan")))) as engine:
        with pytest.raises(TaskError, match=r"task 'watchdog' failed on batch 3 \(step 3, thread 'main'\)"):
            engine.run(range(6))
