"""Property tests over random valid plans: random lookaheads, thread maps, ticket orders and batch counts.

Whatever the plan, every batch reaches every task exactly once, every edge's order holds, and the results
equal those of the single-threaded legacy run. A random ticket order is either rejected by the plan check
or runs without deadlock (a step timeout would catch one).
"""

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import engine_threads
from invariants import assert_all_invariants
from tracing import TracingWorkload

from lightning_hstu import Engine, PlanError, get_plan, make_plan
from lightning_hstu.hstu.tasks import hstu_tasks
from lightning_hstu.plan import EdgeKind

TASKS = hstu_tasks()
THREAD_NAMES = ["io", "compute", "data_dist", "prefetch", "t4"]


@st.composite
def lookaheads(draw):
    """A lookahead per task such that no consumer runs before its producer; stateful tasks stay at 0."""
    consumers = {t.name: [] for t in TASKS}
    for consumer in TASKS:
        for slot in consumer.reads:
            for producer in TASKS:
                if slot in producer.writes:
                    consumers[producer.name].append(consumer.name)
    la = {}
    for task in reversed(TASKS):  # consumers come later in plan order
        floor = max((la[c] for c in consumers[task.name]), default=0)
        la[task.name] = 0 if task.stateful else floor + draw(st.integers(0, 2))
    return la


thread_maps = st.fixed_dictionaries({t.name: st.sampled_from(THREAD_NAMES) for t in TASKS})
settings.register_profile("engine", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_legacy_cache = {}


def legacy_outputs(batches, prefetch):
    key = (batches, prefetch)
    if key not in _legacy_cache:
        plan = get_plan("legacy_none", prefetch=prefetch)
        workload = TracingWorkload(plan)
        with Engine(plan, workload.bodies()) as engine:
            engine.run(range(batches))
        _legacy_cache[key] = (workload.outputs, workload.weights)
    return _legacy_cache[key]


def run_and_check(plan, batches, seed):
    workload = TracingWorkload(plan, max_delay_s=0.0003, seed=seed)
    with Engine(plan, workload.bodies(), step_timeout=20) as engine:
        engine.run(range(batches))
    assert engine_threads() == []
    assert_all_invariants(plan, workload.runs, batches)
    prefetch = any(e.kind == EdgeKind.SYNC for e in plan.edges)
    assert (workload.outputs, workload.weights) == legacy_outputs(batches, prefetch)


@settings(settings.get_profile("engine"))
@given(
    la=lookaheads(),
    thread_map=thread_maps | st.none(),
    batches=st.integers(0, 12),
    prefetch=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_random_plans_keep_the_invariants(la, thread_map, batches, prefetch, seed):
    plan = make_plan(la, thread_map, prefetch)
    run_and_check(plan, batches, seed)


@settings(settings.get_profile("engine"))
@given(
    la=lookaheads(),
    thread_map=thread_maps,
    batches=st.integers(1, 8),
    seed=st.integers(0, 1000),
    swaps=st.integers(1, 3),
)
def test_a_ticket_order_the_check_accepts_never_deadlocks(la, thread_map, batches, seed, swaps):
    # A few swaps of neighbours: about a third of such orders pass the check (a full shuffle almost never).
    order = list(get_plan("default_d3").ticket_order)
    rng = random.Random(seed)
    for _ in range(swaps):
        i = rng.randrange(len(order) - 1)
        order[i], order[i + 1] = order[i + 1], order[i]
    try:
        plan = make_plan(la, thread_map, ticket_order=order)
    except PlanError as error:
        assert "can deadlock" in str(error)
        return
    run_and_check(plan, batches, seed)
