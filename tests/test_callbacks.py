"""The callbacks that show the engine, in real CPU fits: NVTX ranges, timing, trace, pictures."""

import json
import threading
from collections import Counter, defaultdict, deque

import nvtx
import pytest
from torch.utils.data import DataLoader, TensorDataset

from lightning_runs import RecordingLogger, fit

from lightning_hstu import PRESET_NAMES, HSTUPipelineStrategy, TaskRecord, get_plan
from lightning_hstu.callbacks import (
    CollectiveInventoryCallback,
    GanttCallback,
    NVTXCallback,
    TaskTimingCallback,
    TraceCallback,
)
from lightning_hstu.cli import main
from lightning_hstu.data.toy import ToyDataModule
from lightning_hstu.hstu.tasks import HSTU_TASK_NAMES


@pytest.fixture
def nvtx_calls(monkeypatch):
    """Every push/pop of an NVTX range, with the thread that made it (the real functions still run)."""
    calls = []
    push, pop = nvtx.push_range, nvtx.pop_range

    def recording_push(message=None, color="blue", domain=None, category=None, payload=None):
        calls.append(("push", threading.current_thread().name, message, payload))
        return push(message=message, color=color, domain=domain, category=category, payload=payload)

    def recording_pop(domain=None):
        calls.append(("pop", threading.current_thread().name, None, None))
        return pop(domain=domain)

    monkeypatch.setattr(nvtx, "push_range", recording_push)
    monkeypatch.setattr(nvtx, "pop_range", recording_pop)
    return calls


def test_nvtx_ranges_are_balanced_per_thread_and_name_task_and_batch(nvtx_calls):
    fit(HSTUPipelineStrategy("per_task_d3"), callbacks=[NVTXCallback(step_ranges=True)], max_epochs=1)
    depth = defaultdict(int)
    for kind, thread, _, _ in nvtx_calls:
        depth[thread] += 1 if kind == "push" else -1
        assert depth[thread] >= 0, thread
    assert all(d == 0 for d in depth.values())
    plan = get_plan("per_task_d3")
    task_ranges = Counter(
        (message.split("@")[0], payload)
        for kind, thread, message, payload in nvtx_calls
        if kind == "push" and thread.startswith("hstu-")
    )
    assert task_ranges == Counter({(t, b): 1 for t in HSTU_TASK_NAMES for b in range(12)})
    for kind, thread, message, payload in nvtx_calls:
        if kind == "push" and thread.startswith("hstu-"):
            task = message.split("@")[0]
            assert thread == f"hstu-{plan.task(task).thread}"  # opened on the thread that runs the task
            assert message == f"{task}@b{payload} la{plan.task(task).lookahead}"
    batch_ranges = [m for kind, t, m, _ in nvtx_calls if kind == "push" and m.startswith("batch ")]
    assert batch_ranges == [f"batch {i}" for i in range(12)]


def test_timing_counts_every_task_once_per_batch_and_waits_only_on_wait_edges(capsys):
    timing = TaskTimingCallback(log_every_n_steps=0)
    fit(HSTUPipelineStrategy("per_task_d3"), callbacks=[timing], max_epochs=2)
    plan = get_plan("per_task_d3")
    assert Counter(r.task for r in timing.records) == Counter({t: 24 for t in HSTU_TASK_NAMES})
    allowed = {(p, c) for p, c in plan.wait_edges}
    for consumer, previous in zip(plan.ticket_order[1:], plan.ticket_order):
        allowed.add((previous, consumer))  # the collective ticket
    waited = {(p, r.task) for r in timing.records for p in r.waited_on}
    assert waited and waited <= allowed
    assert all(r.wait == 0 or r.waited_on for r in timing.records if r.wait > 1e-3)
    table = capsys.readouterr().out
    assert "per-task host timing (per_task_d3" in table and "finalize_model_grads" in table


def test_the_trace_has_a_track_per_thread_and_every_task_of_the_traced_steps(tmp_path):
    path = tmp_path / "trace.json"
    fit(
        HSTUPipelineStrategy("full_split_d6"),
        callbacks=[TraceCallback(str(path), first_batch=4, num_batches=3)],
        max_epochs=1,
    )
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert tracks == set(get_plan("full_split_d6").threads)
    slices = [e for e in events if e["ph"] == "X"]
    assert Counter(e["name"] for e in slices) == Counter({t: 3 for t in HSTU_TASK_NAMES})
    assert {e["args"]["step"] for e in slices} == {4, 5, 6}
    assert all(e["args"]["batch"] == e["args"]["step"] + e["args"]["lookahead"] for e in slices)
    starts = [e for e in events if e["ph"] == "s"]
    finishes = [e for e in events if e["ph"] == "f"]
    assert len(starts) == len(finishes) > 0  # full_split_d6 waits (at least on the ticket)


def test_a_second_fit_traces_and_times_its_own_batches(tmp_path, capsys):
    """A second fit of one Trainer: the trace showed the first fit's steps again (its records were kept and
    its batch count went on), and the timing table counted both fits."""
    path = tmp_path / "trace.json"
    timing = TaskTimingCallback(log_every_n_steps=0)
    _, trainer = fit(
        HSTUPipelineStrategy("default_d6"),
        callbacks=[TraceCallback(str(path), first_batch=2, num_batches=1), timing],
        max_epochs=1,
    )
    first = json.loads(path.read_text())
    trainer.fit_loop.max_epochs = 2
    trainer.fit(trainer.lightning_module, trainer.datamodule)
    second = json.loads(path.read_text())
    steps = lambda trace: {e["args"]["step"] for e in trace["traceEvents"] if e["ph"] == "X"}  # noqa: E731
    assert steps(first) == steps(second) == {2}  # each fit's own batch 2 (epoch 0, then epoch 1)
    assert first != second  # taken anew
    assert Counter(r.task for r in timing.records) == Counter({t: 12 for t in HSTU_TASK_NAMES})


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: TraceCallback(first_batch=-1), "first_batch must be at least 0, got -1"),
        (lambda: TraceCallback(num_batches=0), "num_batches must be at least 1, got 0"),
        (lambda: GanttCallback(batch=-3), "batch must be at least 0, got -3"),
        (lambda: TaskTimingCallback(log_every_n_steps=-5), "log_every_n_steps must be at least 0, got -5"),
        (lambda: TaskTimingCallback(max_records=0), "max_records must be at least 1, got 0"),
    ],
)
def test_bad_callback_arguments_are_refused_naming_them(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_trace_that_starts_after_the_last_batch_says_so(tmp_path):
    with pytest.warns(UserWarning, match="fit trained 12 batches, the trace starts at batch 100: nothing written"):
        fit(HSTUPipelineStrategy("default_d6"), callbacks=[TraceCallback(str(tmp_path / "t.json"), 100)], max_epochs=1)
    assert not (tmp_path / "t.json").exists()


def test_pictures_are_written(tmp_path, capsys):
    fit(HSTUPipelineStrategy("default_d6"), callbacks=[GanttCallback(str(tmp_path / "gantt"), batch=5)], max_epochs=1)
    assert main(["presets", "--plot", str(tmp_path / "topology")]) == 0
    for path in [tmp_path / "gantt.png", *(tmp_path / "topology" / f"{n}.png" for n in PRESET_NAMES)]:
        data = path.read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000, path
        assert path.with_suffix(".svg").read_text().lstrip().startswith("<?xml")


def test_the_inventory_gives_autograds_backward_collectives_to_the_backward_task():
    """On a GPU autograd's device thread launches the backward all-to-all while the backward task waits:
    a launch outside any engine range on its own thread, inside the backward range in time."""
    from lightning_hstu.callbacks.collectives import AUTOGRAD_THREAD, RANGE_PREFIX, inventory_from

    trace = [
        trace_event(f"{RANGE_PREFIX}backward@7|compute", 1, 100, 50),
        trace_event(f"{RANGE_PREFIX}start_shuffle@9|io", 2, 90, 80),
        trace_event("c10d::alltoall_base_", 3, 120, 5),  # autograd's thread, during backward
        trace_event("nccl:all_to_all", 3, 121, 3, **{"Input Dims": [[64, 8]], "Input type": ["float"]}),
        trace_event("c10d::allgather_", 2, 95, 4),  # the io thread's own launch
        trace_event("c10d::allreduce_", 3, 300, 5),
    ]  # after every range: not an engine task's
    got = [(c.task, c.batch, c.thread, c.operation, c.payload_bytes) for c in inventory_from(trace)]
    assert got == [
        ("start_shuffle", 9, "io", "allgather", None),
        ("backward", 7, AUTOGRAD_THREAD, "alltoall", 64 * 8 * 4),
    ]


def test_the_inventory_reads_an_nccl_launch_from_its_comms_record_and_the_drivers_kernel_launch():
    """NCCL: no backend event to pair with; ``record_param_comms`` inside the launch has the size, dtype and
    process group, and the kernel is launched through the driver API (cuLaunchKernelEx)."""
    from lightning_hstu.callbacks.collectives import RANGE_PREFIX, inventory_from

    trace = [
        trace_event(f"{RANGE_PREFIX}wait_input_dist@4|data_dist", 1, 100, 50),
        trace_event("c10d::alltoall_base_", 1, 110, 20),
        trace_event(
            "record_param_comms",
            1,
            111,
            15,
            **{
                "In msg nelems": 96,
                "dtype": "Long",
                "Process Group Name": "0",
                "Process Group Description": "default_pg",
            },
        ),
        trace_event("cuLaunchKernelEx", 1, 115, 2, cat="cuda_driver", correlation=42),
        trace_event("ncclDevKernel_SendRecv", 7, 116, 30, cat="kernel", correlation=42, stream=13),
    ]
    (got,) = inventory_from(trace)
    assert (got.task, got.batch, got.thread, got.operation) == ("wait_input_dist", 4, "data_dist", "alltoall")
    assert (got.payload_bytes, got.process_group, got.stream) == (96 * 8, "0 (default_pg)", 13)


def test_the_inventory_pairs_a_gloo_launch_with_its_workers_event_not_with_an_nccl_launchs():
    """A gloo collective runs on its group's worker thread after its launch returns. NCCL launches on other
    threads in between carry their size themselves (``record_param_comms``, or a backend event inside the
    launch) and take none of the worker's events: each launch gets its own size."""
    from lightning_hstu.callbacks.collectives import RANGE_PREFIX, inventory_from

    trace = [
        trace_event("c10d::allreduce_", 1, 20, 2),  # between steps (not an engine task's), on gloo
        trace_event("gloo:all_reduce", 9, 30, 2, **{"Input Dims": [[3]], "Input type": ["long int"]}),
        trace_event(f"{RANGE_PREFIX}global_tokens_allreduce@6|data_dist", 2, 90, 60),
        trace_event("c10d::allreduce_", 2, 92, 4),  # on NCCL, before the gloo launch: its size in its comms record
        trace_event("record_param_comms", 2, 93, 2, **{"In msg nelems": 1, "dtype": "Long"}),
        trace_event(f"{RANGE_PREFIX}forward@5|compute", 1, 100, 50),
        trace_event("c10d::allreduce_", 1, 101, 2),  # the forward's, on gloo
        trace_event(f"{RANGE_PREFIX}finalize_model_grads@4|compute_2", 3, 100, 50),
        trace_event("c10d::allreduce_", 3, 102, 4),  # on NCCL: its backend event inside the launch
        trace_event("nccl:all_reduce", 3, 103, 2, **{"Input Dims": [[10]], "Input type": ["float"]}),
        trace_event("gloo:all_reduce", 9, 110, 2, **{"Input Dims": [[2]], "Input type": ["float"]}),
    ]
    got = [(c.task, c.batch, c.payload_bytes) for c in inventory_from(trace)]
    assert got == [("global_tokens_allreduce", 6, 8), ("forward", 5, 2 * 4), ("finalize_model_grads", 4, 40)]


def test_the_inventory_pairs_gloo_launches_with_their_events_when_two_workers_start_them_out_of_order():
    """gloo runs a group's collectives on several worker threads: the second launch's event may start first.
    The event's tensor shape names its launch."""
    from lightning_hstu.callbacks.collectives import RANGE_PREFIX, inventory_from

    launch_types = ["long int", "long int", "", "ScalarList"]
    trace = [
        trace_event(f"{RANGE_PREFIX}wait_input_dist@12|compute", 1, 100, 100),
        trace_event(
            "c10d::alltoall_base_", 1, 110, 5, **{"Input Dims": [[64], [64], [], []], "Input type": launch_types}
        ),
        trace_event(
            "c10d::alltoall_base_", 1, 120, 5, **{"Input Dims": [[5720], [5501], [], []], "Input type": launch_types}
        ),
        trace_event("gloo:all_to_all", 8, 126, 20, **{"Input Dims": [[5501]], "Input type": ["long int"]}),
        trace_event("gloo:all_to_all", 9, 130, 30, **{"Input Dims": [[64]], "Input type": ["long int"]}),
    ]
    got = [c.payload_bytes for c in inventory_from(trace)]
    assert got == [64 * 8, 5501 * 8]


def trace_event(name, tid, ts, dur, cat="cpu_op", **args):
    """One complete ("X") event of a profiler's exported trace, as the inventory reads it."""
    return {"ph": "X", "cat": cat, "name": name, "tid": tid, "ts": ts, "dur": dur, "args": args}


def test_fit_summary_counts_the_samples_of_each_fit_it_times(capsys):
    """The toy batches are (items, ratings) tuples of 8 samples: counted as 2 each before (the tuple's length);
    a second fit of the same Trainer counted the first fit's samples too, over its own time."""
    from lightning_hstu.callbacks import FitSummary

    summary = FitSummary()
    _, trainer = fit(HSTUPipelineStrategy("default_d6"), callbacks=[summary], max_epochs=1)
    assert "trained 96 samples in 1 epochs" in capsys.readouterr().out  # 12 batches of 8
    trainer.fit_loop.max_epochs = 2
    trainer.fit(trainer.lightning_module, trainer.datamodule)
    assert "trained 96 samples in 1 epochs" in capsys.readouterr().out  # the second fit's one epoch
    fit(HSTUPipelineStrategy("default_d6"), callbacks=[FitSummary()], max_epochs=3, max_steps=18)
    assert "trained 144 samples in 1.5 epochs" in capsys.readouterr().out  # it said 1 (and for 30 steps, 3)

    class Growing(ToyDataModule):  # reloaded each epoch: 5 batches, then 15
        def train_dataloader(self):
            n = 40 if self.trainer.current_epoch == 0 else 120
            return DataLoader(TensorDataset(self.items[:n], self.ratings[:n]), batch_size=8)

    fit(
        HSTUPipelineStrategy("default_d6"),
        data_cls=Growing,
        data_kwargs=dict(num_samples=128),
        callbacks=[FitSummary()],
        limit_val_batches=0,
        reload_dataloaders_every_n_epochs=1,
    )
    assert "trained 160 samples in 2 epochs" in capsys.readouterr().out


def test_timing_logs_once_per_logged_step_under_gradient_accumulation():
    logger = RecordingLogger()
    timing = TaskTimingCallback(log_every_n_steps=2, print_table=False)
    fit(HSTUPipelineStrategy("default_d6"), callbacks=[timing], max_epochs=1, accumulate_grad_batches=3, logger=logger)
    steps = [step for step, metrics in logger.rows if any(key.startswith("timing/") for key in metrics)]
    assert steps == [0, 2, 4]  # 12 batches, an optimizer step every 3: [0, 0, 2, 2, 2, 4] before


def test_timing_without_logging_keeps_no_more_than_max_records():
    """``log_every_n_steps=0`` logs nothing: the callback must still hold only the last ``max_records`` task
    records, however long the fit (it kept every record of the fit besides them before)."""
    timing = TaskTimingCallback(log_every_n_steps=0, print_table=False, max_records=20)
    fit(HSTUPipelineStrategy("default_d6"), callbacks=[timing], max_epochs=2)
    held = sum(
        isinstance(item, TaskRecord)
        for value in vars(timing).values()
        if isinstance(value, list | deque)
        for item in value
    )
    assert held == 20


def test_the_collective_inventory_counts_a_second_fits_batches_from_its_start(tmp_path):
    """As the trace and the timing table, the chosen batch is counted from the start of each fit: a second
    fit of the Trainer records its own batch 2 (it went on counting from the first fit's 12 and recorded
    nothing before)."""
    inventory = CollectiveInventoryCallback(batch=2, path=None, print_table=False, trace_dir=str(tmp_path))
    _, trainer = fit(HSTUPipelineStrategy("default_d6"), callbacks=[inventory], max_epochs=1)
    recorded = tmp_path / "collectives_batch2_rank0.json"
    assert recorded.exists()
    recorded.unlink()
    trainer.fit_loop.max_epochs = 2
    trainer.fit(trainer.lightning_module, ToyDataModule())
    assert recorded.exists()
