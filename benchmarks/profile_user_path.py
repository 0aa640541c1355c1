"""Runs one mode of the user's path (``Trainer(strategy=HSTUPipelineStrategy(preset, capture_graphs=...))``)
on one GPU for long enough to attach a sampling profiler to it, and says when the steady state starts:

    python benchmarks/profile_user_path.py --workload light --preset default_d6 --graphs --steps 1500 &
    # when the file named by --ready appears: py-spy record --pid $(cat /tmp/profile_ready) --threads ...

The batches, model sizes and Trainer settings are those of ``hstu_pipelines.py``'s user's-path rows;
``--plain`` runs its plain loop instead (no Trainer), so that each mode can be timed alone in a process;
``--engine`` drives ``Engine`` directly with ``--preset`` (and ``--graphs``), as ``hstu_pipelines.py``'s Engine
rows do (torch's AdamW stepping eagerly; with ``--on-nonfinite-loss stop`` the loss's finite flag read by the
watchdog task as the user's path reads it, else no check of the loss), so that the user's path minus it, the
strategy's own cost, is timed process against process;
``--eager-optimizer`` runs the user's path with torch's AdamW stepping eagerly too (``hstu_pipelines.py``'s
``EagerOptimizerStep``), the optimizer the Engine rows use.
Without a GPU it runs on the CPU (gloo); ``--small`` takes ``hstu_pipelines.py --small``'s sizes;
``--compile-layers`` builds the model with ``compile_layers=True`` (``hstu_pipelines.py --compile-layers on``).

Two diagnostics of the steady state, from the end of the warmup on:

- ``--sync-debug``: every call that makes the host wait for the GPU (``torch.cuda.set_sync_debug_mode``),
  counted per thread and call site and printed per step at the end (CUDA only);
- ``--trace FILE``: torch.profiler over ``--trace-steps`` steps (CPU ops of every thread, CUDA kernels), a
  Chrome trace written to FILE and, printed, each thread's busiest ops and its CUDA runtime calls that wait
  (synchronize, blocking copies) with their total time; FILE.counts.json holds every thread's ops and
  CUDA runtime calls per step (count, self CPU us), to compare two modes; ``--trace-stacks`` records the
  Python frames too (``with_stack``: each op's callers, at a cost of its own);
- ``--thread-cpu``: each thread's CPU time per step over the measured steps (Linux: ``/proc/self/task``;
  the engine's threads by their Python names, autograd's device thread as ``pt_autograd_0``), and the wall
  time of ``torch.autograd.backward`` per call (the caller of backward waits for autograd's thread there).
  Without a profiler's overhead: the threads' times add up to the step where they run one after another.

``--switch-interval S`` sets ``sys.setswitchinterval(S)`` (the GIL's hand-over interval) for the run.
``--pin-python-threads CORE`` puts the threads that run Python under the GIL (the caller's, the engine's
``hstu-*``) on that one core from the end of the warmup, and leaves torch's own threads (autograd's device
thread, NCCL's, the pinned-memory thread) where they were: a GIL hand-off then never moves a thread's
Python working set from one core's caches to another's (on the 2-core CPU machine that took a toy step
from 849 to 578 us, BENCHMARKS.md). ``--pin-threads CORE`` does it through the strategy's own option,
``HSTUPipelineStrategy(pin_threads=CORE)`` (the caller's and the engine's threads on that core from the end
of the epoch's first batch)."""

import argparse
import collections
import json
import os
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from hstu_pipelines import (
    SMALL,
    WORKLOADS,
    EagerOptimizerStep,
    _Batches,
    _collections,
    _minus,
    _window_notes,
    build_model,
    cycled,
    make_batches,
    model_sizes,
    run_engine,
    run_plain,
    user_path_trainer,
)

from lightning_hstu import HSTUPipelineStrategy
from lightning_hstu.engine.affinity import ThreadPin
from lightning_hstu.models.hstu import HSTURecommender, dense_adamw


class _Marks(pl.Callback):
    """Writes ``path`` after ``warmup`` steps and prints the ms/step of every ``every`` steps after it, with the
    time Python's garbage collector ran in those steps where it ran (``hstu_pipelines._window_notes``); starts the
    diagnostics there (``_SyncSites``, ``_Trace``) and stops the trace after its steps."""

    def __init__(self, warmup, every, path, diagnostics=()):
        self.warmup, self.every, self.path, self.start = warmup, every, Path(path), None
        self.diagnostics, self.collected = diagnostics, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        done = batch_idx - self.warmup
        for diagnostic in self.diagnostics:
            diagnostic.at_step(done)
        if done < 0 or done % self.every:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now, collected = time.perf_counter(), _collections()
        if self.start is not None:
            ms = (now - self.start) * 1e3 / self.every
            gc = _window_notes({}, _minus(collected, self.collected))
            print(f"steps {done - self.every}-{done}: {ms:.2f} ms/step{gc}", flush=True)
        else:
            self.path.write_text(str(os.getpid()))
        self.start, self.collected = now, collected


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="light", choices=list(WORKLOADS))
    parser.add_argument("--preset", default="default_d6")
    parser.add_argument("--graphs", action="store_true")
    parser.add_argument("--lightning", action="store_true", help="Lightning's own loop (engine=False)")
    parser.add_argument("--plain", action="store_true", help="the benchmark's plain PyTorch loop, no Trainer")
    parser.add_argument(
        "--engine",
        action="store_true",
        help="Engine driven directly with --preset, no Trainer (with --on-nonfinite-loss stop its watchdog task reads "
        "the loss's finite flag as the user's path does)",
    )
    parser.add_argument("--eager-optimizer", action="store_true", help="the user's path with torch's AdamW, eager")
    parser.add_argument("--on-nonfinite-loss", default="raise", help="HSTURecommender's on_nonfinite_loss")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--batches", type=int, default=110, help="distinct batches, cycled (the benchmark's 10 + 100)")
    parser.add_argument("--ready", default="/tmp/profile_ready")
    parser.add_argument("--small", action="store_true", help="hstu_pipelines.py's tiny sizes (for a CPU run)")
    parser.add_argument(
        "--compile-layers", action="store_true", help="HSTURecommender(compile_layers=True), as hstu_pipelines.py's"
    )
    parser.add_argument("--sync-debug", action="store_true", help="count the host's waits for the GPU per call site")
    parser.add_argument("--trace", help="write a torch.profiler Chrome trace of --trace-steps steps to this file")
    parser.add_argument("--trace-steps", type=int, default=20)
    parser.add_argument("--trace-stacks", action="store_true", help="the trace records Python frames (with_stack)")
    parser.add_argument("--thread-cpu", action="store_true", help="each thread's CPU time per step (Linux)")
    parser.add_argument("--switch-interval", type=float, help="sys.setswitchinterval for the run, in seconds")
    parser.add_argument("--pin-python-threads", type=int, metavar="CORE", help="the Python threads on this core")
    parser.add_argument("--pin-threads", type=int, metavar="CORE", help="HSTUPipelineStrategy(pin_threads=CORE)")
    parser.add_argument(
        "--step-timeout",
        type=lambda value: None if value == "none" else float(value),
        default=600.0,
        help="HSTUPipelineStrategy(step_timeout=...) in seconds, or none (default 600, as hstu_pipelines.py)",
    )
    args = parser.parse_args()
    loops = [flag for flag in ("plain", "lightning", "engine") if getattr(args, flag)]
    if len(loops) > 1:
        parser.error(f"one loop at a time: {', '.join('--' + flag for flag in loops)}")
    if (args.pin_threads is not None or args.step_timeout != 600.0 or args.eager_optimizer) and loops:
        parser.error(
            "--pin-threads, --step-timeout and --eager-optimizer are the user's path's options: "
            "not with --plain, --lightning or --engine"
        )
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.sync_debug and not torch.cuda.is_available():
        parser.error("--sync-debug needs CUDA")
    if args.trace and not 0 < args.trace_steps <= args.steps:
        parser.error(f"--trace-steps must be in 1..--steps ({args.steps})")
    diagnostics = (
        ([_SyncSites()] if args.sync_debug else [])
        + ([_Trace(args.trace, args.trace_steps, args.trace_stacks)] if args.trace else [])
        + ([_ThreadCPU(args.steps - 1)] if args.thread_cpu else [])
        + ([_PinPython(args.pin_python_threads)] if args.pin_python_threads is not None else [])
    )
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29518")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    sizes = {**(SMALL if args.small else WORKLOADS[args.workload]), "compile_layers": args.compile_layers}
    num_items = 1000 if args.small else 1_000_000
    batches = make_batches(args.batches, 32, sizes["max_len"], num_items, 16)
    total = args.warmup + args.steps
    if args.plain:
        marks = _Marks(args.warmup, args.every, args.ready, diagnostics)
        _plain_loop(sizes, device, num_items, cycled(batches, total), marks)
        _report(diagnostics)
        dist.destroy_process_group()
        return
    if args.engine:
        marks = _Marks(args.warmup, args.every, args.ready, diagnostics)
        check = args.on_nonfinite_loss == "stop"  # as the user's path checks the loss
        _engine_loop(sizes, device, num_items, args.preset, args.graphs, cycled(batches, total), marks, check)
        _report(diagnostics)
        dist.destroy_process_group()
        return
    model = (EagerOptimizerStep if args.eager_optimizer else HSTURecommender)(
        **model_sizes(sizes),
        sparse_optimizer="sgd",
        lr=1e-4,
        balance_batches=True,
        on_nonfinite_loss=args.on_nonfinite_loss,
    )
    strategy = (
        HSTUPipelineStrategy(engine=False)
        if args.lightning
        else HSTUPipelineStrategy(
            preset=args.preset,
            capture_graphs=args.graphs,
            step_timeout=args.step_timeout,
            pin_threads=args.pin_threads,
        )
    )
    trainer = user_path_trainer(strategy, device, total, [_Marks(args.warmup, args.every, args.ready, diagnostics)])
    trainer.fit(model, _Batches(cycled(batches, total), num_items))
    _report(diagnostics)
    dist.destroy_process_group()


def _report(diagnostics) -> None:
    for diagnostic in diagnostics:
        diagnostic.report()


class _PinPython:
    """At the end of the warmup, the caller's and the engine's threads on one core (Linux), by the strategy's
    ``ThreadPin``; ``release`` gives them their cores back."""

    def __init__(self, core: int):
        self.threads = ThreadPin(core)
        self.pinned: list[str] = []

    def at_step(self, done: int) -> None:
        if done == 0:
            self.pin()

    def pin(self) -> None:
        python = [t for t in threading.enumerate() if t.name == "MainThread" or t.name.startswith("hstu-")]
        self.threads.pin(python)
        self.pinned += [thread.name for thread in python]

    def release(self) -> None:
        self.threads.release()

    def report(self) -> None:
        print(f"pinned to core {self.threads.core}: {', '.join(self.pinned)}")


class _SyncSites:
    """Counts the calls that synchronise with the GPU from step 0 on, by thread and by the innermost frames
    of the call site, through ``torch.cuda.set_sync_debug_mode("warn")`` (a warning at every such call)."""

    FRAMES = 4

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self.steps = 0

    def at_step(self, done: int) -> None:
        if done == 0:
            warnings.filterwarnings("always", message=".*synchroniz")
            self._show, warnings.showwarning = warnings.showwarning, self._record
            torch.cuda.set_sync_debug_mode("warn")
        self.steps = max(self.steps, done)

    def _record(self, message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return self._show(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if "/warnings.py" not in f.filename]
        site = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-self.FRAMES :]))
        self.counts[(threading.current_thread().name, site)] += 1

    def report(self) -> None:
        torch.cuda.set_sync_debug_mode(0)
        print(f"\nsynchronising calls per step (over {self.steps} steps), by thread and call site:")
        for (thread, site), count in self.counts.most_common(25):
            print(f"{count / max(1, self.steps):8.2f}  {thread:14s} {site}")


class _Trace:
    """torch.profiler over steps 0 .. ``steps`` - 1 after the warmup; writes a Chrome trace and prints, per
    thread, its busiest ops (self CPU time) and its CUDA runtime calls that wait for the device."""

    WAITS = ("Synchronize", "cudaMemcpy ", "cudaMemcpy2D ", "cudaStreamWaitEvent")

    def __init__(self, path: str, steps: int, stacks: bool = False):
        self.path, self.steps, self.stacks, self.profiler = path, steps, stacks, None

    def at_step(self, done: int) -> None:
        if done == 0:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            # every thread (the engine's and autograd's, not only the one starting the profiler), and the
            # device's synchronisations as events of their own
            config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True, enable_cuda_sync_events=True)
            self.profiler = torch.profiler.profile(
                activities=activities, experimental_config=config, with_stack=self.stacks
            )
            self.profiler.start()
        elif done == self.steps and self.profiler is not None:
            self._finish()

    def report(self) -> None:
        if self.profiler is not None:
            self._finish()

    def _finish(self) -> None:
        profiler, self.profiler = self.profiler, None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        profiler.stop()
        profiler.export_chrome_trace(self.path)
        busy: dict = collections.defaultdict(collections.Counter)
        waits: dict = collections.defaultdict(collections.Counter)
        calls: dict = collections.defaultdict(collections.Counter)
        for event in profiler.events():
            if event.device_type != torch.autograd.DeviceType.CPU:
                continue
            busy[event.thread][event.name] += event.self_cpu_time_total
            calls[event.thread][event.name] += 1
            if event.name.startswith("cuda") and any(w in event.name + " " for w in self.WAITS):
                waits[event.thread][event.name] += event.cpu_time_total
        print(f"\ntorch.profiler over {self.steps} steps (trace: {self.path}); us per step:")
        for thread, ops in sorted(busy.items(), key=lambda kv: -sum(kv[1].values())):
            top = ", ".join(f"{name} {us / self.steps:.0f}" for name, us in ops.most_common(6))
            print(f"thread {thread}: {sum(ops.values()) / self.steps:.0f} self CPU; {top}")
            if waits[thread]:
                print("    waits: " + ", ".join(f"{n} {us / self.steps:.0f}" for n, us in waits[thread].most_common()))
        # every thread's ops and CUDA runtime calls, per step: count and self CPU us (to compare two modes' files)
        per_step = {
            str(thread): {name: [calls[thread][name] / self.steps, us / self.steps] for name, us in ops.items()}
            for thread, ops in busy.items()
        }
        Path(self.path + ".counts.json").write_text(json.dumps(per_step, indent=0, sort_keys=True))


class _ThreadCPU:
    """Each thread's CPU time (user + system, from ``/proc/self/task/<id>/stat``) from step 0 to step
    ``last`` (read while the threads live), per step, and the wall time of each ``torch.autograd.backward``
    call in those steps."""

    def __init__(self, last: int):
        self.last = last
        self.start: tuple[float, dict] | None = None
        self.end: tuple[float, dict] | None = None
        self.backward_s: list[float] = []
        self._backward = torch.autograd.backward

        def timed(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return self._backward(*args, **kwargs)
            finally:
                if self.start is not None and self.end is None:
                    self.backward_s.append(time.perf_counter() - begin)

        torch.autograd.backward = timed

    def at_step(self, done: int) -> None:
        if done == 0:
            self.start = (time.perf_counter(), _thread_cpu_s())
        elif done == self.last and self.start is not None:
            self.end = (time.perf_counter(), _thread_cpu_s())

    def report(self) -> None:
        torch.autograd.backward = self._backward
        if self.start is None or self.end is None:
            return
        (began, before), (ended, after) = self.start, self.end
        steps = self.last
        print(f"\nthreads' CPU time over {steps} steps ({(ended - began) / steps * 1e3:.2f} ms/step of wall time):")
        spent = {name: (seconds - before.get(name, 0.0)) / steps * 1e3 for name, seconds in after.items()}
        for name, ms in sorted(spent.items(), key=lambda kv: -kv[1]):
            if ms >= 0.05:
                print(f"  {name:24s} {ms:6.2f} ms/step")
        backward = sorted(self.backward_s)
        if backward:
            print(f"  backward() wall time: median {backward[len(backward) // 2] * 1e3:.3f} ms per call")


def _thread_cpu_s() -> dict[str, float]:
    """CPU seconds per thread of this process, named by Python thread name where there is one (else the
    kernel's thread name, made unique by its id)."""
    python_names = {str(t.native_id): t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    times = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        name = python_names.get(tid, f"{comm} ({tid})")
        times[name] = (int(fields[11]) + int(fields[12])) / tick
    return times


def _plain_loop(sizes, device, num_items, batches, marks):
    """``hstu_pipelines.py``'s plain loop (``run_plain``: same model, optimizer and autocast) over
    ``batches``, timed by ``marks`` as the Trainer's steps are."""
    model = build_model(sizes, device, num_items)
    optimizer = dense_adamw(model.objectives.parameters(), lr=1e-4)
    run_plain(model, optimizer, "cuda" if device.type == "cuda" else None)(_marked(batches, marks))


def _engine_loop(sizes, device, num_items, preset, graphs, batches, marks, check_finite=False):
    """``hstu_pipelines.py``'s Engine rows (``run_engine``: same model, AdamW and autocast; the step timeout
    600 s, as the user's path's default) over ``batches``, timed by ``marks`` as the Trainer's steps are;
    ``check_finite``: the loss's finite flag read by the watchdog task, as ``on_nonfinite_loss="stop"``."""
    model = build_model(sizes, device, num_items)
    optimizer = dense_adamw(model.objectives.parameters(), lr=1e-4)
    autocast = "cuda" if device.type == "cuda" else None
    capture = graphs and device.type == "cuda"
    run, engine = run_engine(model, optimizer, autocast, device, preset, capture=capture, check_finite=check_finite)
    try:
        run(_marked(batches, marks))
    finally:
        engine.close()


def _marked(batches, marks):
    for index, batch in enumerate(batches):
        marks.on_train_batch_start(None, None, batch, index)
        yield batch


if __name__ == "__main__":
    main()
