"""Bad configuration gets a clear error naming the culprit and the valid choices."""

import pytest

from lightning_hstu import PRESET_NAMES, PlanError, get_plan, make_plan
from lightning_hstu.hstu.presets import THREAD_MAPS
from lightning_hstu.hstu.tasks import HSTU_TASK_NAMES
from lightning_hstu.plan import Stream, TaskDef, build_plan

DEFAULT_MAP = dict(THREAD_MAPS["default"])


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(PlanError) as info:
        get_plan("default_d4")
    message = str(info.value)
    assert "'default_d4'" in message
    for name in PRESET_NAMES:
        assert name in message


def test_unknown_cascade_and_thread_map_names():
    with pytest.raises(PlanError, match=r"unknown cascade 'd4'.*d3, d6"):
        make_plan("d4")
    with pytest.raises(PlanError, match=r"unknown thread map 'fastest'.*default, by_stream, per_task"):
        make_plan("d3", "fastest")


def test_thread_map_missing_a_task():
    thread_map = {k: v for k, v in DEFAULT_MAP.items() if k not in ("watchdog", "zero_grad")}
    with pytest.raises(PlanError, match="misses tasks 'zero_grad', 'watchdog'"):
        make_plan("d3", thread_map)


def test_thread_map_inventing_a_task():
    with pytest.raises(PlanError, match=r"unknown task 'emb_lookup'.*h2d, start_shuffle"):
        make_plan("d3", {**DEFAULT_MAP, "emb_lookup": "compute"})


def test_thread_map_written_as_thread_to_tasks_is_rejected():
    with pytest.raises(PlanError, match="unknown task 'io'"):
        make_plan("d3", {"io": ("h2d", "start_shuffle", "finish_shuffle"), "compute": ("forward",)})
    with pytest.raises(PlanError, match="task 'h2d' maps to"):
        make_plan("d3", {**DEFAULT_MAP, "h2d": ("io",)})


def test_lookahead_that_puts_a_consumer_before_its_producer_names_both():
    cascade = {"h2d": 2, "start_shuffle": 2, "finish_shuffle": 1, "start_input_dist": 2}
    with pytest.raises(PlanError) as info:
        make_plan(cascade, "default")
    assert "consumer 'start_input_dist' (lookahead 2)" in str(info.value)
    assert "producer 'finish_shuffle' (lookahead 1)" in str(info.value)


def test_lookahead_of_a_stateful_task_must_be_zero():
    with pytest.raises(PlanError, match=r"task 'zero_grad' uses model state.*got 2"):
        make_plan({**{"h2d": 2}, "zero_grad": 2})


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_lookahead_must_be_a_non_negative_int(value):
    with pytest.raises(PlanError, match="lookahead of task 'h2d' must be an int >= 0"):
        make_plan({"h2d": value})


def test_lookahead_naming_an_unknown_task():
    with pytest.raises(PlanError, match="lookahead names unknown task 'h2D'"):
        make_plan({"h2D": 2})


def test_ticket_order_given_as_a_bare_string_is_rejected():
    with pytest.raises(PlanError, match="ticket_order must be a sequence of task names"):
        make_plan("d3", "default", ticket_order="start_shuffle")


def test_ticket_order_must_list_every_collective_once():
    with pytest.raises(PlanError, match="each collective task exactly once"):
        make_plan("d3", "default", ticket_order=["start_shuffle", "finish_shuffle"])


def test_ticket_order_against_a_threads_own_order_can_deadlock():
    order = list(get_plan("default_d6").ticket_order)
    order[0], order[1] = order[1], order[0]  # finish_shuffle before start_shuffle, both on "io"
    with pytest.raises(PlanError) as info:
        make_plan("d6", "default", ticket_order=order)
    assert "collective ticket order can deadlock" in str(info.value)
    assert "start_shuffle -[thread io]-> finish_shuffle -[ticket]-> start_shuffle" in str(info.value)


def test_ticket_order_across_threads_that_can_deadlock_names_the_cycle():
    order = list(get_plan("per_task_d3").ticket_order)
    order.remove("finalize_model_grads")
    order.insert(order.index("backward"), "finalize_model_grads")
    with pytest.raises(PlanError, match=r"backward -\[ord edge\]-> finalize_model_grads -\[ticket\]-> backward"):
        make_plan("d3", "per_task", ticket_order=order)


def test_a_ticket_order_that_cannot_deadlock_is_accepted():
    # The global token count may go first: nothing it waits for needs a later ticket.
    order = list(get_plan("full_split_d6").ticket_order)
    order.remove("global_tokens_allreduce")
    order.insert(0, "global_tokens_allreduce")
    plan = make_plan("d6", "full_split", ticket_order=order)
    assert plan.ticket_order[0] == "global_tokens_allreduce"


def _task(name, reads=(), writes=(), **kw):
    return TaskDef(name, Stream.DEFAULT, tuple(reads), tuple(writes), **kw)


def test_a_cycle_between_tasks_is_named():
    tasks = [_task("a", ["batch", "y"], ["x"]), _task("b", ["x"], ["y"])]
    with pytest.raises(PlanError, match=r"task order can deadlock: .*a -\[ord edge\]-> b"):
        build_plan(tasks, {}, {"a": "t1", "b": "t2"})


def test_consumer_before_producer_on_one_thread_is_a_cycle():
    tasks = [_task("consumer", ["x"]), _task("producer", ["batch"], ["x"])]
    with pytest.raises(PlanError, match=r"consumer -\[thread t\]-> producer -\[ord edge\]-> consumer"):
        build_plan(tasks, {}, {"consumer": "t", "producer": "t"})


def test_reading_a_slot_nobody_writes():
    with pytest.raises(PlanError, match="task 'a' reads slot 'ghost' that no task writes"):
        build_plan([_task("a", ["ghost"])], {}, None)


def test_two_writers_of_one_slot():
    with pytest.raises(PlanError, match="slot 'x' is written by both 'a' and 'b'"):
        build_plan([_task("a", writes=["x"]), _task("b", writes=["x"])], {}, None)


def test_depends_on_an_unknown_task():
    with pytest.raises(PlanError, match="depends_on of task 'a' names unknown task 'zz'"):
        build_plan([_task("a", depends_on=("zz",))], {}, None)


def test_every_task_name_is_valid_in_a_full_thread_map():
    plan = make_plan("d3", {name: f"t{i % 3}" for i, name in enumerate(HSTU_TASK_NAMES)})
    assert len(plan.threads) == 3
