"""The engine's invariants (docs/concepts.md), checked on the runs a ``TracingWorkload`` recorded."""

from collections import Counter

from lightning_hstu import Plan
from lightning_hstu.plan import EdgeKind


def assert_every_batch_through_every_task_once(plan: Plan, runs, batches: int) -> None:
    counts = Counter((r.task, r.batch) for r in runs)
    expected = {(t.name, b): 1 for t in plan.tasks for b in range(batches)}
    assert dict(counts) == expected


def assert_lookahead_respected(plan: Plan, runs) -> None:
    for r in runs:
        assert r.batch == r.step + plan.task(r.task).lookahead, r


def assert_edges_respected(plan: Plan, runs) -> None:
    by_key = {(r.task, r.batch): r for r in runs}
    for edge in plan.edges:
        la_p, la_c = plan.task(edge.producer).lookahead, plan.task(edge.consumer).lookahead
        for consumer in (r for r in runs if r.task == edge.consumer):
            if edge.kind == EdgeKind.ORD:
                producer = by_key[(edge.producer, consumer.batch)]
            else:  # sync: the producer's run of the same step, if it had a batch then
                producer = by_key.get((edge.producer, consumer.step + la_p))
                if producer is None:
                    continue
            assert producer.end < consumer.begin, (edge, producer, consumer)
        assert la_p >= la_c or edge.kind == EdgeKind.SYNC


def assert_step_barrier(runs) -> None:
    last_end = {}
    first_begin = {}
    for r in runs:
        last_end[r.step] = max(last_end.get(r.step, -1), r.end)
        first_begin[r.step] = min(first_begin.get(r.step, 1 << 60), r.begin)
    steps = sorted(last_end)
    for a, b in zip(steps, steps[1:]):
        assert last_end[a] < first_begin[b], (a, b)


def assert_all_invariants(plan: Plan, runs, batches: int) -> None:
    assert_every_batch_through_every_task_once(plan, runs, batches)
    assert_lookahead_respected(plan, runs)
    assert_edges_respected(plan, runs)
    assert_step_barrier(runs)
