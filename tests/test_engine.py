"""The engine on every preset: every batch through every task once, in edge order, same results as the
sequential baseline; fill, drain, early stop; records."""

import threading
import time

import pytest

from invariants import assert_all_invariants
from tracing import TracingWorkload

from lightning_hstu import PRESET_NAMES, SKIPPED, Engine, EngineError, PlanError, get_plan
from lightning_hstu.engine import format_summary, summarize
from lightning_hstu.engine.schedule import schedule


def run_workload(plan, batches, **kwargs):
    workload = TracingWorkload(plan, **kwargs)
    with Engine(plan, workload.bodies()) as engine:
        records = engine.run(range(batches))
    return workload, records


@pytest.fixture(scope="module")
def legacy_result():
    workload, _ = run_workload(get_plan("legacy_none"), 11)
    return workload


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_every_preset_keeps_the_invariants_and_matches_legacy(name, legacy_result):
    plan = get_plan(name)
    workload, records = run_workload(plan, 11, max_delay_s=0.0005, seed=PRESET_NAMES.index(name))
    assert_all_invariants(plan, workload.runs, 11)
    # d6 runs its tasks on the same batches, only earlier: results equal the d3 legacy run
    assert workload.outputs == legacy_result.outputs
    assert workload.weights == legacy_result.weights
    assert len(records) == 11 * len(plan.tasks)


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("name", ["legacy_none", "per_task_d3", "full_split_d6"])
@pytest.mark.parametrize("batches", [0, 1, 2, 3, 5, 6])
def test_fewer_batches_than_the_ring(name, batches):
    plan = get_plan(name)
    workload, _ = run_workload(plan, batches)
    assert_all_invariants(plan, workload.runs, batches)


@pytest.mark.usefixtures("no_thread_left")
def test_threads_run_their_tasks_on_the_planned_thread():
    plan = get_plan("full_split_d6")
    workload, records = run_workload(plan, 8)
    for run in workload.runs:
        assert run.thread == f"hstu-{plan.task(run.task).thread}"
    assert {r.thread for r in records} == set(plan.threads)


def test_legacy_runs_on_the_callers_thread():
    plan = get_plan("legacy_none")
    workload, _ = run_workload(plan, 4)
    assert {r.thread for r in workload.runs} == {threading.current_thread().name}


@pytest.mark.usefixtures("no_thread_left")
def test_steps_fill_then_train_then_drain():
    plan = get_plan("default_d6")
    workload = TracingWorkload(plan)
    with Engine(plan, workload.bodies()) as engine:
        results = list(engine.steps(range(8)))
    assert [r.step for r in results] == list(range(-5, 8))
    assert [r.batch for r in results] == [None] * 5 + list(range(8))
    first = {rec.task for rec in results[0].records}
    assert first == {"h2d"}  # the fill: only the deepest lookahead has a batch
    last = {rec.task for rec in results[-1].records}
    assert last == {t.name for t in plan.tasks if t.lookahead == 0}  # the drain


@pytest.mark.usefixtures("no_thread_left")
def test_stopping_early_keeps_the_engine_for_the_next_epoch():
    plan = get_plan("full_split_d3")
    workload = TracingWorkload(plan)
    with Engine(plan, workload.bodies()) as engine:
        for result in engine.steps(range(10)):
            if result.batch == 3:
                break  # max_steps / limit_train_batches cut the epoch short
        trained = {r.batch for r in workload.runs if r.task == "optimizer_step"}
        assert trained == {0, 1, 2, 3}
        workload.runs.clear()
        engine.run(range(4))
    assert_all_invariants(plan, workload.runs, 4)


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("name", ["legacy_none", "default_d6"])
def test_the_loader_thread_pulls_the_next_batch_while_a_step_runs(name):
    """With a step timeout the batches come through the loader thread, which is asked for batch k + depth
    when step k is dispatched: step k's optimizer step waits here until that pull began."""
    plan = get_plan(name)
    asked: dict[int, threading.Event] = {}

    def batches():
        for index in range(8):
            asked.setdefault(index, threading.Event()).set()
            yield index

    workload = TracingWorkload(plan)
    bodies = workload.bodies()
    optimizer_step = bodies["optimizer_step"]

    def optimizer_step_after_the_pull_ahead(batch):
        ahead = batch.index + plan.depth
        if ahead < 8:
            assert asked.setdefault(ahead, threading.Event()).wait(20), f"batch {ahead} not asked for during step"
        return optimizer_step(batch)

    bodies["optimizer_step"] = optimizer_step_after_the_pull_ahead
    with Engine(plan, bodies, step_timeout=60) as engine:
        engine.run(batches())
    assert_all_invariants(plan, workload.runs, 8)


@pytest.mark.usefixtures("no_thread_left")
def test_no_pull_runs_while_the_caller_works_between_steps():
    """The pull ahead starts when a step is dispatched, not while ``before_step`` runs (Lightning's hooks under
    the strategy): a loader's Python work (a collate function's) and the caller's would share the GIL there,
    in a section of the step no other work overlaps."""
    plan = get_plan("legacy_none")
    pulling, seen = threading.Event(), []

    def batches():
        for index in range(10):
            pulling.set()
            time.sleep(0.01)  # the loader's work on this batch
            pulling.clear()
            yield index

    def before_step(step):
        for _ in range(3):
            seen.append((step, pulling.is_set()))
            time.sleep(0.005)
        return True

    workload = TracingWorkload(plan)
    with Engine(plan, workload.bodies(), step_timeout=60) as engine:
        for _ in engine.steps(batches(), before_step):
            pass
    assert len(seen) == 3 * (10 + plan.depth - 1)  # every step, the fill's included
    assert [step for step, busy in seen if busy] == []
    assert_all_invariants(plan, workload.runs, 10)


@pytest.mark.usefixtures("no_thread_left")
def test_a_run_cut_short_waits_for_the_pull_ahead_and_leaves_the_iterator_alone():
    plan = get_plan("default_d3")
    pulled = []

    def batches():
        for index in range(20):
            if index == plan.depth + 3:
                time.sleep(0.2)  # still pulling when the run is cut short
            pulled.append(index)
            yield index

    workload = TracingWorkload(plan)
    with Engine(plan, workload.bodies(), step_timeout=60) as engine:
        for result in engine.steps(batches()):
            if result.batch == 3:
                break
        # batches 0 .. 3 + depth - 1 went into the ring, the next one was pulled ahead and is dropped
        assert pulled == list(range(plan.depth + 4))
        workload.runs.clear()
        engine.run(range(4))  # the next epoch pulls from its own iterator
    assert_all_invariants(plan, workload.runs, 4)
    assert pulled == list(range(plan.depth + 4))


def test_records_mark_skipped_tasks_and_time_waits():
    plan = get_plan("default_d6")
    workload = TracingWorkload(plan)
    bodies = workload.bodies()
    bodies["start_shuffle"] = None  # nothing to do: skipped
    bodies["finish_shuffle"] = lambda batch: (batch.__setitem__("shuffled_batch", batch["device_batch"]), SKIPPED)[1]
    with Engine(plan, bodies) as engine:
        records = engine.run(range(6))
    by_task = {}
    for r in records:
        by_task.setdefault(r.task, []).append(r)
    assert all(r.skipped for r in by_task["start_shuffle"] + by_task["finish_shuffle"])
    assert not any(r.skipped for r in by_task["forward"])
    assert all(r.wait >= 0 and r.end >= r.start for r in records)
    table = format_summary(summarize(records, [t.name for t in plan.tasks]))
    assert "start_shuffle" in table and "wait ms" in table


def test_bodies_must_cover_the_plan():
    plan = get_plan("default_d3")
    bodies = {t.name: None for t in plan.tasks}
    with pytest.raises(PlanError, match="no body for task 'watchdog'"):
        Engine(plan, {k: v for k, v in bodies.items() if k != "watchdog"})
    with pytest.raises(PlanError, match="unknown task 'fwd'"):
        Engine(plan, {**bodies, "fwd": None})


def test_an_engine_must_be_started_and_starts_once():
    plan = get_plan("default_d3")
    engine = Engine(plan, {t.name: None for t in plan.tasks})
    with pytest.raises(EngineError, match="call start"):
        list(engine.steps(range(2)))
    engine.start()
    with pytest.raises(EngineError, match="starts once"):
        engine.start()
    engine.close()
    with pytest.raises(EngineError, match="closed"):
        list(engine.steps(range(2)))


@pytest.mark.usefixtures("no_thread_left")
def test_before_step_sees_the_batch_about_to_train_and_can_end_the_run():
    plan = get_plan("default_d6")
    workload = TracingWorkload(plan)
    seen = []
    with Engine(plan, workload.bodies()) as engine:

        def before_step(step):
            if step >= 0:
                slots = engine.slots(step)  # batch `step` reaches lookahead 0 in this step
                seen.append((step, slots["batch"], "device_batch" in slots, "loss" in slots))
                with pytest.raises(TypeError):
                    slots["batch"] = 0  # read-only for the caller
            return step < 4

        results = list(engine.steps(range(100, 110), before_step))
    assert seen == [(k, 100 + k, True, False) for k in range(5)]
    assert [r.batch for r in results][-1] == 3  # step 4 never ran


@pytest.mark.usefixtures("no_thread_left")
def test_a_run_can_number_its_batches_from_a_resume_point():
    plan = get_plan("full_split_d6")
    workload = TracingWorkload(plan)
    with Engine(plan, workload.bodies()) as engine:
        results = list(engine.steps(range(4), start=7))
    assert [r.batch for r in results if r.batch is not None] == [7, 8, 9, 10]
    assert results[0].step == 7 - (plan.depth - 1)
    assert sorted({r.batch for r in workload.runs}) == [7, 8, 9, 10]
    assert all(r.batch == r.step + plan.task(r.task).lookahead for r in workload.runs)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_a_task_records_a_cuda_event_only_where_one_is_read(name):
    """Each event costs the recording thread's host time, every task and step: a task records one where a
    task on another stream consumes its results (that stream waits for it) or where it is a collective
    (a hung step's report asks whose collective work is unfinished), and nowhere else."""
    plan = get_plan(name)
    scheduled = {s.task.name: s for tasks in schedule(plan, {t.name: None for t in plan.tasks}).values() for s in tasks}
    read = {e.producer for e in plan.edges if plan.task(e.producer).stream != plan.task(e.consumer).stream}
    for task in plan.tasks:
        assert scheduled[task.name].records_event == (task.name in read or task.collective), task.name
    assert not scheduled["forward"].records_event  # consumed on its own stream only, in every preset
