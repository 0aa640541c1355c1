"""The plan API on the nine presets: the tasks, cascades and thread maps each must have."""

import pytest

from lightning_hstu import PRESET_NAMES, PlanError, Stream, get_plan, make_plan
from lightning_hstu.hstu.presets import resolve_plan
from lightning_hstu.hstu.tasks import GRAPH_TASKS, HSTU_TASK_NAMES

D3 = {
    "h2d": 2,
    "start_shuffle": 2,
    "finish_shuffle": 2,
    "start_input_dist": 1,
    "wait_input_dist": 1,
    "prefetch_embeddings": 1,
}
D6 = {
    "h2d": 5,
    "start_shuffle": 4,
    "finish_shuffle": 3,
    "start_input_dist": 3,
    "wait_input_dist": 2,
    "prefetch_embeddings": 1,
}
STREAMS = {
    "h2d": "memcpy",
    "start_shuffle": "memcpy",
    "finish_shuffle": "memcpy",
    "start_input_dist": "data_dist",
    "wait_input_dist": "data_dist",
    "prefetch_embeddings": "prefetch",
    "zero_grad": "default",
    "global_tokens_allreduce": "default",
    "compute_output_dist": "default",
    "forward": "default",
    "backward": "default",
    "finalize_model_grads": "default",
    "optimizer_step": "default",
    "watchdog": "default",
}
THREAD_COUNTS = {
    "legacy_none": 1,
    "default_d3": 2,
    "by_stream_d3": 4,
    "per_task_d3": 14,
    "io_prefetch_compute_d3": 3,
    "io_data_dist_compute_d3": 3,
    "full_split_d3": 4,
    "default_d6": 2,
    "full_split_d6": 4,
}
IO = ("h2d", "start_shuffle", "finish_shuffle")
LA0_CHAIN = [
    ("zero_grad", "backward"),
    ("global_tokens_allreduce", "forward"),
    ("compute_output_dist", "forward"),
    ("forward", "backward"),
    ("backward", "finalize_model_grads"),
    ("finalize_model_grads", "optimizer_step"),
    ("optimizer_step", "watchdog"),
]


def test_preset_names_in_spec_order():
    assert PRESET_NAMES == (
        "legacy_none",
        "default_d3",
        "by_stream_d3",
        "per_task_d3",
        "io_prefetch_compute_d3",
        "io_data_dist_compute_d3",
        "full_split_d3",
        "default_d6",
        "full_split_d6",
    )


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_preset_lookaheads_streams_and_depth(name):
    plan = get_plan(name)
    cascade = D6 if name.endswith("d6") else D3
    assert [t.name for t in plan.tasks] == list(HSTU_TASK_NAMES)
    for task in plan.tasks:
        assert task.lookahead == cascade.get(task.name, 0), task.name
        assert task.stream == STREAMS[task.name]
        assert isinstance(task.stream, Stream)
    assert plan.depth == (6 if name.endswith("d6") else 3)
    assert plan.cascade == ("d6" if name.endswith("d6") else "d3")


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_preset_threads_cover_every_task_once(name):
    plan = get_plan(name)
    assert len(plan.threads) == THREAD_COUNTS[name]
    placed = [task for tasks in plan.threads.values() for task in tasks]
    assert sorted(placed) == sorted(HSTU_TASK_NAMES)
    for thread, tasks in plan.threads.items():
        assert all(plan.task(t).thread == thread for t in tasks)
        # tasks of one thread run in plan order
        assert list(tasks) == [t for t in HSTU_TASK_NAMES if t in tasks]


def test_legacy_runs_everything_on_the_callers_thread_without_waits():
    plan = get_plan("legacy_none")
    assert plan.legacy
    assert dict(plan.threads) == {"main": HSTU_TASK_NAMES}
    assert plan.wait_edges == frozenset()


def test_thread_groups_of_the_presets():
    assert set(get_plan("default_d3").threads["io"]) == set(IO)
    assert set(get_plan("by_stream_d3").threads) == {"memcpy", "data_dist", "prefetch", "default"}
    assert get_plan("io_prefetch_compute_d3").threads["prefetch"] == ("prefetch_embeddings",)
    assert get_plan("io_data_dist_compute_d3").threads["data_dist"] == ("start_input_dist", "wait_input_dist")
    full = get_plan("full_split_d6").threads
    assert (full["io"], full["data_dist"], full["prefetch"]) == (
        IO,
        ("start_input_dist", "wait_input_dist"),
        ("prefetch_embeddings",),
    )


@pytest.mark.parametrize("name", [n for n in PRESET_NAMES if n.endswith("d3")])
def test_d3_has_no_wait_from_io_to_other_threads(name):
    plan = get_plan(name)
    assert ("finish_shuffle", "start_input_dist") not in plan.wait_edges
    io_thread = plan.task("finish_shuffle").thread
    leaving_io = [
        (p, c)
        for p, c in plan.wait_edges
        if plan.task(p).thread == io_thread and plan.task(c).thread != io_thread and c not in IO
    ]
    assert leaving_io == []


@pytest.mark.parametrize("name", ["default_d6", "full_split_d6"])
def test_d6_waits_for_the_shuffle_before_input_dist(name):
    assert ("finish_shuffle", "start_input_dist") in get_plan(name).wait_edges


def test_default_d6_waits_only_at_the_shuffle():
    assert get_plan("default_d6").wait_edges == {("finish_shuffle", "start_input_dist")}


def test_per_task_waits_on_every_cross_thread_edge_of_the_lookahead0_cluster():
    waits = get_plan("per_task_d3").wait_edges
    for edge in LA0_CHAIN:
        assert edge in waits
    # edges between different lookaheads never wait inside a step
    assert ("finish_shuffle", "start_input_dist") not in waits
    assert ("wait_input_dist", "compute_output_dist") not in waits


@pytest.mark.parametrize("name", ["by_stream_d3", "io_prefetch_compute_d3", "full_split_d3", "full_split_d6"])
def test_prefetch_on_its_own_thread_syncs_with_backward(name):
    assert ("prefetch_embeddings", "backward") in get_plan(name).wait_edges
    assert ("prefetch_embeddings", "backward") not in get_plan(name, prefetch=False).wait_edges


def test_prefetch_on_the_compute_thread_needs_no_wait():
    assert ("prefetch_embeddings", "backward") not in get_plan("default_d3").wait_edges


def test_ticket_order_lists_the_collective_tasks_in_plan_order():
    assert get_plan("default_d6").ticket_order == (
        "start_shuffle",
        "finish_shuffle",
        "start_input_dist",
        "wait_input_dist",
        "global_tokens_allreduce",
        "compute_output_dist",
        "backward",
        "finalize_model_grads",
    )


def test_custom_cascade_and_thread_map():
    cascade = {"h2d": 3, "start_shuffle": 3, "finish_shuffle": 2, "start_input_dist": 2}
    thread_map = {t: ("loader" if t in IO else "trainer") for t in HSTU_TASK_NAMES}
    plan = make_plan(cascade, thread_map)
    assert plan.cascade == "custom" and plan.depth == 4
    assert plan.task("wait_input_dist").lookahead == 0  # not named: lookahead 0
    assert set(plan.threads) == {"loader", "trainer"}
    assert ("finish_shuffle", "start_input_dist") in plan.wait_edges
    assert ("h2d", "start_shuffle") not in plan.wait_edges  # same thread: plan order suffices


def test_make_plan_with_preset_parts_equals_the_preset():
    a, b = make_plan("d3", "full_split"), get_plan("full_split_d3")
    assert [(t.name, t.lookahead, t.thread) for t in a.tasks] == [(t.name, t.lookahead, t.thread) for t in b.tasks]
    assert a.wait_edges == b.wait_edges


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_a_preset_without_changes_resolves_to_the_preset(name):
    assert resolve_plan(name).describe() == get_plan(name).describe()
    plan = resolve_plan(name, prefetch=False, capturable=GRAPH_TASKS)  # options of any plan keep the name
    assert plan.describe() == get_plan(name, prefetch=False, capturable=GRAPH_TASKS).describe()
    assert plan.name == name


def test_changes_to_a_preset_replace_only_their_part():
    assert resolve_plan("full_split_d6", cascade="d3").describe() == make_plan("d3", "full_split").describe()
    assert resolve_plan("full_split_d3", thread_map="per_task").describe() == make_plan("d3", "per_task").describe()
    legacy = resolve_plan("default_d6", thread_map="none")
    assert legacy.legacy and legacy.cascade == "d6" and legacy.name == "custom"
    assert dict(legacy.threads) == {"main": HSTU_TASK_NAMES}
    order = list(get_plan("full_split_d6").ticket_order)
    order.remove("global_tokens_allreduce")
    order.insert(0, "global_tokens_allreduce")
    reordered = resolve_plan("full_split_d6", ticket_order=order)
    assert reordered.ticket_order == tuple(order) and reordered.name == "custom"
    assert reordered.threads == get_plan("full_split_d6").threads


def test_resolve_plan_checks_the_preset_name_like_get_plan():
    with pytest.raises(PlanError, match="unknown preset 'fastest'; valid presets: legacy_none, default_d3"):
        resolve_plan("fastest", cascade="d3")


def test_describe_names_threads_tasks_and_waits():
    text = get_plan("default_d6").describe()
    assert "io: h2d@5 start_shuffle@4 finish_shuffle@3" in text
    assert "waits: finish_shuffle -> start_input_dist" in text


def test_unknown_task_lookup_is_a_plan_error():
    with pytest.raises(PlanError, match="no task 'fwd'.*forward"):
        get_plan("default_d3").task("fwd")


def test_plan_error_is_a_value_error():
    assert issubclass(PlanError, ValueError)
