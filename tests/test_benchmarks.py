"""``benchmarks/hstu_pipelines.py``, the benchmark BENCHMARKS.md's rows come from: its user's-path rows time the
batches its Engine and plain-loop rows time (each timed window of ``Trainer.fit`` runs the measured batches in
their order, never the warm-up ones, so that the difference between a user's-path row and an Engine row is the
path's cost, not the batches' lengths), and its CPU run times every mode."""

import gc
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ranks import run_script

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import gpu_clocks  # noqa: E402
import hstu_pipelines  # noqa: E402
from hstu_pipelines import _StepTimer, windowed  # noqa: E402


def _windows(data, timer, steps):
    """The windows the timer times and profiles: from each of its edges, ``steps`` batches."""
    starts = [index for index in range(len(data)) if timer._edge(index)]
    return [data[start : start + steps] for start in starts]


@pytest.mark.parametrize("warm_passes", [0, 3])
def test_every_timed_window_runs_the_measured_batches_in_order(warm_passes):
    warmup, steps, repeats = 5, 10, 3
    batches = [object() for _ in range(warmup + steps)]  # distinct batches, compared by identity
    data, timed_from = windowed(batches, warmup, repeats, warm_passes)
    timer = _StepTimer(timed_from, steps, repeats, torch.device("cpu"))
    windows = _windows(data, timer, steps)
    assert len(windows) == repeats + 1  # the timed ones and the profiled one, every one whole
    for window in windows:
        assert [id(b) for b in window] == [id(b) for b in batches[warmup:]]
    assert data[:warmup] == batches[:warmup] and timed_from == warmup + warm_passes * steps
    assert data[warmup:timed_from] == batches[warmup:] * warm_passes  # untimed windows, as measure's passes


@pytest.mark.parametrize("fresh", [0, 10])
def test_fresh_windows_run_batches_no_window_ran_before(fresh, monkeypatch):
    """``--fresh``: each window of a row driven directly (warm passes, timed windows, profile) runs batches of its
    own, in order, so that no timed step meets a batch an earlier step met (a training run's token counts); the
    row's timed batches (whose FLOPs its MFU takes) are its timed windows'. Without it each window runs every
    measured batch."""
    warmup, steps, repeats, warm_passes = 5, 10, 3, 2
    windows = warm_passes + repeats + 1 if fresh else 1
    batches = list(range(warmup + steps * windows))
    ran = []
    monkeypatch.setattr(hstu_pipelines, "kernels_per_step", lambda run, window, device: (run(window), (None, []))[1])
    monkeypatch.setattr(hstu_pipelines, "timed", lambda run, window, device: (float(len(ran)), run(window)))
    result = hstu_pipelines.measure(
        "row", ran.append, batches, warmup, repeats, torch.device("cpu"), warm_passes, fresh=fresh
    )
    assert ran[0] == batches[:warmup] and len(ran) == 1 + warm_passes + repeats + 1
    if fresh:
        assert sum(ran[1:], []) == batches[warmup:]  # every batch once, window after window
        assert result["timed"] == batches[warmup + warm_passes * steps : warmup + (warm_passes + repeats) * steps]
    else:
        assert all(window == batches[warmup:] for window in ran[1:])
        assert result["timed"] == batches[warmup:] * repeats
    assert result["windows"] == [float(1 + warm_passes + i) for i in range(repeats)]  # each timed window's ms


def test_garbage_collections_are_counted_from_the_first_read_and_not_hooked_into_gc_at_import():
    """Importing the benchmark (the tests and the other benchmarks do) leaves ``gc.callbacks`` alone; its counter
    goes in at the first read, and counts each collection after it, a full one as full."""
    script = "import gc; n = len(gc.callbacks); import hstu_pipelines; print(len(gc.callbacks) - n)"
    benchmarks = Path(__file__).parents[1] / "benchmarks"
    added = subprocess.run(
        [sys.executable, "-c", script], cwd=benchmarks, capture_output=True, text=True, check=True
    ).stdout.split()[-1]
    assert added == "0"
    before = hstu_pipelines._collections()
    gc.collect()
    gc.collect(0)
    after = hstu_pipelines._collections()
    assert after["collections"] - before["collections"] >= 2 and after["full"] - before["full"] >= 1


def test_each_timed_windows_allocator_calls_and_garbage_collections_are_reported_beside_its_time(monkeypatch):
    """A row driven directly reports, beside each timed window's ms per step, the caching allocator's calls and
    Python's garbage collections made in that window alone (not in the warm-up, the other windows or the
    profile), so that a window slowed by a retry (the allocator's cache freed and allocated again) or by a
    full collection (every Python thread waits while it scans the process's objects) is told from one slowed
    otherwise."""
    warmup, steps, repeats = 5, 10, 3
    batches = list(range(warmup + steps * (repeats + 1)))
    calls = {"num_device_alloc": 0, "num_device_free": 0, "num_alloc_retries": 0}
    collected = {"collections": 0, "full": 0, "ms": 0.0}
    made = iter([(4, 0, 0), (0, 0, 0), (12, 9, 1), (0, 1, 0), (2, 2, 0)])  # warm-up, three windows, profile
    collections = iter([(30, 1, 90.0), (0, 0, 0.0), (4, 1, 212.5), (2, 0, 0.25), (9, 1, 80.0)])

    def run(window):
        for key, n in zip(calls, next(made)):
            calls[key] += n
        for key, n in zip(collected, next(collections)):
            collected[key] += n

    monkeypatch.setattr(hstu_pipelines, "_allocator_calls", lambda device: dict(calls))
    monkeypatch.setattr(hstu_pipelines, "_collections", lambda: dict(collected))
    monkeypatch.setattr(hstu_pipelines, "kernels_per_step", lambda run, window, device: (run(window), (None, []))[1])
    monkeypatch.setattr(hstu_pipelines, "timed", lambda run, window, device: (50.0 + len(window) / 10, run(window)))
    result = hstu_pipelines.measure("row", run, batches, warmup, repeats, torch.device("cpu"), fresh=steps)
    assert result["window_allocator"] == [
        {"num_device_alloc": 0, "num_device_free": 0, "num_alloc_retries": 0},
        {"num_device_alloc": 12, "num_device_free": 9, "num_alloc_retries": 1},
        {"num_device_alloc": 0, "num_device_free": 1, "num_alloc_retries": 0},
    ]
    assert result["window_collector"] == [
        {"collections": 0, "full": 0, "ms": 0.0},
        {"collections": 4, "full": 1, "ms": 212.5},
        {"collections": 2, "full": 0, "ms": 0.25},
    ]
    assert hstu_pipelines.windows_line(result) == (
        "ms per step in each timed window of 'row', in order: 51.00, 51.00 (12 cudaMalloc, 9 cudaFree, 1 retries, "
        "gc 212.5 ms, 4 collections, 1 full), 51.00 (1 cudaFree, gc 0.2 ms, 2 collections)"
    )
    per_step = {"num_device_alloc": 12 / 30, "num_device_free": 10 / 30, "num_alloc_retries": 1 / 30}  # 30 timed
    assert result["allocator"] == pytest.approx(per_step)


def test_with_clocks_each_timed_window_and_the_kernel_profile_report_the_gpus_clock_in_them(monkeypatch):
    """``--clocks``: each timed window of a row is read with the clock readings of its own span (not the warm-up's,
    the other windows' or the profile's), and the row reports the timed windows' clock beside its kernel
    profile's, whose kernel time the table's "kernel ms" is."""
    warmup, steps, repeats = 5, 10, 3
    batches = list(range(warmup + steps))
    sampler = gpu_clocks.ClockSampler()  # not started: each window below adds the reading that arrived in it
    arriving = iter(
        [
            gpu_clocks.Reading(1000, 100, 0x4),  # the warm-up's, in no window
            gpu_clocks.Reading(1980, 300, 0),
            gpu_clocks.Reading(1800, 690, 0x4),  # the second timed window held the power cap
            gpu_clocks.Reading(1980, 300, 0),
            gpu_clocks.Reading(1980, 300, 0),  # the kernel profile's
        ]
    )

    def run(window):
        sampler.readings.append((time.perf_counter(), next(arriving)))

    monkeypatch.setattr(hstu_pipelines, "kernels_per_step", lambda run, window, device: (run(window), (None, []))[1])
    monkeypatch.setattr(hstu_pipelines, "timed", lambda run, window, device: (52.0, run(window)))
    result = hstu_pipelines.measure("row", run, batches, warmup, repeats, torch.device("cpu"), clocks=sampler)
    assert [w["readings"] for w in result["window_clocks"]] == [1] * repeats
    assert [w["mean_mhz"] for w in result["window_clocks"]] == [1980, 1800, 1980]
    assert result["profile_clocks"]["readings"] == 1 and result["profile_clocks"]["mean_mhz"] == 1980
    assert hstu_pipelines.windows_line(result) == (
        "ms per step in each timed window of 'row', in order: 52.00 (SM 1980 MHz, 300 W, power-capped 0%), "
        "52.00 (SM 1800 MHz, 690 W, power-capped 100%), 52.00 (SM 1980 MHz, 300 W, power-capped 0%)"
    )
    assert hstu_pipelines.clocks_line(result) == (
        "the GPU during the timed windows of 'row': SM 1920 MHz, 430 W, power-capped 33%, least 1800 MHz "
        "(3 readings); clock limited by: power cap; during its kernel profile SM 1980 MHz, 300 W, power-capped 0%"
    )
    without = hstu_pipelines.measure("row", lambda window: None, batches, warmup, repeats, torch.device("cpu"))
    assert without["window_clocks"] == [None] * repeats and hstu_pipelines.clocks_line(without) is None


def test_a_user_path_rows_timer_keeps_the_span_of_each_timed_window_and_of_the_profiled_one():
    """The spans ``--clocks`` reads a user's-path row's clock over: one per timed window, then the profiled
    window's, in order, none overlapping."""
    warmup, steps, repeats = 5, 10, 3
    data, timed_from = windowed(list(range(warmup + steps)), warmup, repeats)
    timer = _StepTimer(timed_from, steps, repeats, torch.device("cpu"))
    for index in range(len(data)):
        timer.on_train_batch_start(None, None, data[index], index)
    timer.on_train_end(None, None)
    assert len(timer.times) == repeats and len(timer.spans) == repeats + 1
    ends = [end for _, end in timer.spans]
    assert all(start <= end for start, end in timer.spans)
    assert all(end <= start for end, (start, _) in zip(ends, timer.spans[1:]))


def test_the_garbage_collections_counted_are_pythons_own():
    """The collections the benchmark reports are those Python ran, whichever thread ran them: a full one counts
    as one full collection, a young one as a collection only, each with its time."""
    gc.disable()  # no automatic collection between the two reads
    try:
        before = hstu_pipelines._collections()
        thread = threading.Thread(target=gc.collect)
        thread.start()
        thread.join()
        gc.collect(0)
        after = hstu_pipelines._collections()
    finally:
        gc.enable()
    assert (after["collections"] - before["collections"], after["full"] - before["full"]) == (2, 1)
    assert after["ms"] > before["ms"]


@pytest.mark.parametrize("mode", ["freeze", "off"])
def test_the_collector_mode_holds_for_the_timed_windows_and_profiles_only(mode, monkeypatch):
    """``--gc freeze`` freezes the objects made by the end of the warm passes (no collection scans them again)
    and ``--gc off`` disables the collector, for the timed windows and the profiles; the warm-up and warm
    passes run with Python's collector as it was, and it is as it was after the row."""
    warmup, steps, repeats, warm_passes = 5, 10, 2, 1
    batches = list(range(warmup + steps))
    seen = []

    def run(window):
        seen.append((gc.isenabled(), gc.get_freeze_count() > 0))

    monkeypatch.setattr(hstu_pipelines, "kernels_per_step", lambda run, window, device: (run(window), (None, []))[1])
    monkeypatch.setattr(hstu_pipelines, "timed", lambda run, window, device: (1.0, run(window)))
    hstu_pipelines.measure("row", run, batches, warmup, repeats, torch.device("cpu"), warm_passes, collector=mode)
    python = (True, False)
    during = (True, True) if mode == "freeze" else (False, False)
    assert seen == [python, python] + [during] * (repeats + 1)  # warm-up, warm pass; windows, kernel profile
    assert (gc.isenabled(), gc.get_freeze_count()) == (True, 0)


def test_an_unknown_collector_mode_is_refused_with_the_modes():
    with pytest.raises(ValueError, match=r"collector mode 'manual': choose one of \['freeze', 'off', 'python'\]"):
        with hstu_pipelines.collector_mode("manual"):
            pass


@pytest.mark.parametrize("graphed", [False, True])
@pytest.mark.parametrize("warm_passes", [0, 1, 6])
def test_with_warm_passes_no_timed_window_is_the_first_to_meet_its_batches(warm_passes, graphed, monkeypatch):
    """``--warm-passes N``: a row runs N untimed passes over the measured batches before its first timed window
    (a graphed row at least the passes its captures need), so that with one or more every timed window repeats
    batches already run; without, the first timed window is the first to meet them."""
    warmup, steps, repeats = 5, 10, 3
    batches = list(range(warmup + steps))
    ran = []
    monkeypatch.setattr(hstu_pipelines, "kernels_per_step", lambda run, window, device: (run(window), (None, []))[1])
    monkeypatch.setattr(hstu_pipelines, "timed", lambda run, window, device: (1.0, run(window)))
    passes = hstu_pipelines.row_warm_passes(warm_passes, graphed)
    hstu_pipelines.measure("row", ran.append, batches, warmup, repeats, torch.device("cpu"), passes)
    assert passes == (max(warm_passes, hstu_pipelines.GRAPH_WARM_PASSES) if graphed else warm_passes)
    first_timed = 1 + passes  # after the warm-up's batches and the untimed passes
    assert ran[first_timed] == batches[warmup:]
    met_before = [batch for window in ran[:first_timed] for batch in window]
    assert all(batch in met_before for batch in ran[first_timed]) == (passes > 0)


def test_a_negative_number_of_warm_passes_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["hstu_pipelines.py", "--small", "--warm-passes", "-1"])
    with pytest.raises(SystemExit):
        hstu_pipelines.main()
    assert "--warm-passes: a number of passes, 0 or more, not -1" in capsys.readouterr().err


@pytest.mark.parametrize("fresh", [0, 10])
def test_an_engine_rows_host_time_per_thread_is_per_step_of_the_window_its_records_cover(fresh, monkeypatch):
    """An Engine row's host ms per step of each thread (and its exposed side chain) divide the task records of
    its last timed window by that window's steps, under ``--fresh`` too, where the batches after the warm-up
    are those of every window."""
    warmup, steps, repeats, warm_passes = 5, 10, 3, 2
    windows = warm_passes + repeats + 1 if fresh else 1
    batches = list(range(warmup + steps * windows))
    record = SimpleNamespace(thread="main", duration=0.004)  # 4 ms of the main thread's host time a step

    def run(window):
        return [record] * len(window)  # the engine's task records of the steps it ran

    monkeypatch.setattr(hstu_pipelines, "kernels_per_step", lambda run, window, device: (None, []))
    monkeypatch.setattr(hstu_pipelines, "timed", lambda run, window, device: (1.0, run(window)))
    result = hstu_pipelines.measure("row", run, batches, warmup, repeats, torch.device("cpu"), warm_passes, fresh=fresh)
    assert result["record_steps"] == steps
    assert hstu_pipelines.thread_host_ms(result["records"], result["record_steps"]) == "main=4.00"


def test_host_work_runs_after_each_layers_attention_and_before_its_backward(monkeypatch):
    """``--host-work F B``: F us of host work on the forward's thread after each layer's attention call and B us
    on autograd's before each layer's attention backward, and the layer's outputs and gradients unchanged."""
    from lightning_hstu.models import hstu_layers

    config = hstu_layers.HSTUConfig(
        embedding_dim=16, num_layers=3, num_heads=2, attention_dim=8, hidden_dim=8, max_seq_len=8, dropout=0.0
    )
    torch.manual_seed(0)
    stack = hstu_layers.HSTUStack(config)
    offsets, times = torch.tensor([0, 3, 8]), torch.arange(8)

    def step():
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y = stack.jagged(x, offsets, times, grouped=True)
        y.square().sum().backward()
        return y.detach(), x.grad

    plain = step()
    spun = []
    monkeypatch.setattr(hstu_pipelines, "busy", spun.append)
    remove = hstu_pipelines.add_host_work(150.0, 40.0)
    try:
        with_work = step()
    finally:
        remove()
    assert spun == [150.0] * 3 + [40.0] * 3  # each layer's forward, then each layer's backward
    assert all(torch.equal(a, b) for a, b in zip(plain, with_work))
    step()
    assert len(spun) == 6  # taken out again


def test_fresh_refuses_too_few_batches():
    with pytest.raises(ValueError, match="--fresh: 6 windows of 10 batches needed after the warm-up, 5 made"):
        hstu_pipelines.measure("row", list, list(range(55)), 5, 3, torch.device("cpu"), 2, fresh=10)


@pytest.mark.parametrize("fresh", [False, True])
def test_under_fresh_the_kernel_profile_is_not_set_against_other_batches_step_time(fresh):
    """A row's kernel profile ran a window of its own: without ``--fresh`` the measured batches again, so the
    step's time outside kernels is the step time minus it; under ``--fresh`` other batches than the timed
    ones, so the report gives no step/kernel ratio and no time outside kernels, but both windows' FLOPs."""
    from lightning_hstu.models.hstu import HSTURecommender

    batches = hstu_pipelines.make_batches(8, 32, 32, 1000, 16)
    model = HSTURecommender(**hstu_pipelines.model_sizes(hstu_pipelines.SMALL), num_items=1000)
    timed, profiled = batches[:4], batches[4:]
    result = dict(
        mode="row", ms=50.0, best=49.0, spread=2.0, kernel_ms=40.0, kernels=[("gemm", 40.0, 10.0)], timed=timed,
        profiled=profiled, records=None, plan=None, record_steps=4, peak_gib=None, windows=[50.0],
    )  # fmt: skip
    lines = []
    hstu_pipelines.report(lines.append, [result], model, timed, 16, 1, 4, kernels=1, fresh=fresh)
    row = next(line for line in lines if line.startswith("row "))
    heaviest = next(line for line in lines if line.startswith("the 1 heaviest"))
    assert row.split()[6] == ("-" if fresh else "1.25")  # step/kernel
    if fresh:
        tflops = [hstu_pipelines.step_flops(model, b, 16) / 1e12 for b in (profiled, timed)]
        assert f"batches of their own, {tflops[0]:.3f} TFLOP per step against the timed {tflops[1]:.3f}" in heaviest
        assert "outside kernels" not in heaviest and tflops[0] != tflops[1]
    else:
        assert "the step's 10.00 ms outside kernels are 1000.00 us per launch" in heaviest


def test_the_allocator_calls_of_a_users_path_row_are_those_of_its_timed_windows(monkeypatch):
    """The caching allocator's calls per step that a user's-path row reports (as the Engine rows report theirs)
    are counted over its timed windows only: not over warm-up, untimed or profiled steps."""
    warmup, steps, repeats, warm_passes = 5, 10, 3, 3
    data, timed_from = windowed(list(range(warmup + steps)), warmup, repeats, warm_passes)
    calls = {"num_device_alloc": 0, "num_device_free": 0, "num_alloc_retries": 0}
    monkeypatch.setattr(hstu_pipelines, "_allocator_calls", lambda device: dict(calls))
    timer = _StepTimer(timed_from, steps, repeats, torch.device("cpu"))
    timed_end = timed_from + repeats * steps
    for batch_idx in range(len(data)):
        timer.on_train_batch_start(None, None, None, batch_idx)
        timed = timed_from <= batch_idx < timed_end
        calls["num_device_alloc"] += 1 if timed else 7  # the step's cudaMalloc calls
        calls["num_device_free"] += 2 if timed else 0
        calls["num_alloc_retries"] += 0 if timed else 1
    assert len(timer.times) == repeats
    assert timer.allocator == {"num_device_alloc": 1.0, "num_device_free": 2.0, "num_alloc_retries": 0.0}


def test_the_benchmark_on_two_ranks_prints_its_tables_and_exits_with_the_runs_status():
    """``torchrun --nproc-per-node 2 hstu_pipelines.py``, as on a machine with two GPUs (here two gloo ranks on the
    CPU): rank 0 prints each shuffler's table with the global samples/s, and the launch exits with 0 (each rank
    ends itself once its groups are destroyed, as gloo's threads can abort a successful rank at the
    interpreter's exit)."""
    import torch.distributed.run as torchrun

    script = Path(__file__).parents[1] / "benchmarks" / "hstu_pipelines.py"
    args = ["--nproc-per-node", "2", script, "--small", "--workloads", "light", "--rows", "plain", "user"]
    args += ["--presets", "legacy_none", "--user-rows", "presets", "--shuffler", "balanced", "identity"]
    args += ["--steps", "2", "--warmup", "1", "--repeats", "1"]
    run = run_script(Path(torchrun.__file__), script.parent, *args, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("\nmode ") == 2  # one table per shuffler, printed once (by rank 0)
    notes = ("ms per step in each timed window of ", "Python's garbage collector during the timed steps of ")
    for table in run.stdout.split("\nmode ")[1:]:
        lines = table.split("\n\n", 1)[0].splitlines()[1:]
        rows = {line[:25].strip(): line[25:].split() for line in lines if not line.startswith(notes)}
        assert set(rows) == {"plain loop", "legacy_none"}
        for samples, everyone in (row[3:5] for row in rows.values()):  # rank 0's samples/s and the global one
            assert float(everyone) > float(samples) > 0


def test_the_benchmark_times_every_mode_at_its_cpu_sizes():
    """``hstu_pipelines.py --small``, the CPU run of the benchmark's commands: one row per mode (the plain loop,
    each preset through Engine and through the Trainer, the loss check, Lightning's loop, TorchRec's
    pipeline), each with a step time."""
    script = Path(__file__).parents[1] / "benchmarks" / "hstu_pipelines.py"
    args = ["--small", "--workloads", "light", "--presets", "legacy_none", "default_d6", "--steps", "3"]
    args += ["--warmup", "2", "--repeats", "2"]
    run = run_script(script, script.parent, *args, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.split("\nmode ", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    windowed = "ms per step in each timed window of "
    collector = "Python's garbage collector during the timed steps of "
    table = [line for line in lines if not line.startswith((windowed, collector))]
    times = {line[:25].strip(): float(line[25:].split()[0]) for line in table}
    windows = {  # each window's ms, with what the allocator and the collector did in it in brackets
        line.split("'")[1]: re.findall(r"(\d+\.\d\d)(?: \([^)]*\))?(?:, |$)", line.split("', in order: ")[1])
        for line in lines
        if line.startswith(windowed)
    }
    collected = [line[len(collector) :].split("'")[1] for line in lines if line.startswith(collector)]
    direct = ["plain loop", "legacy_none (Engine)", "default_d6 (Engine)", "TrainPipelineSparseDist"]
    assert sorted(windows) == sorted(direct) and all(len(w) == 2 for w in windows.values())  # --repeats 2
    assert sorted(collected) == sorted(direct)
    fastest = min(("legacy_none", "default_d6"), key=lambda preset: times[f"{preset} (Engine)"])  # checks the loss
    modes = ["plain loop", "legacy_none (Engine)", "default_d6 (Engine)", "legacy_none", "default_d6"]
    assert list(times) == [*modes, f"{fastest}, stop", "Lightning loop", "TrainPipelineSparseDist"]
    assert all(ms > 0 for ms in times.values())
