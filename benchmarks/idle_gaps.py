"""Where the GPU waits for the host: the idle time between a step's kernels, read from a torch.profiler trace
(CPU and CUDA activities), and for each idle gap what the host was doing when it launched the kernel that
ended the gap.

A gap is time in which no kernel, copy or memset runs on any stream. Each gap is charged to the kernel that
ends it, and through that kernel's launch (the CUDA runtime or driver call with the same correlation id) to
the host: the engine task open on the launching thread (a ``record_function`` range ``task <name>`` that
``ranged_bodies`` opens around each task body), the outermost profiler op enclosing the launch (an aten op,
an autograd node, a compiled region) and the kernel's name. A gap during which a host call that waits for the
device (a synchronize or a blocking copy) returned is charged to that call instead: the host drained the
queue, and the kernels after it start from an empty one. Recording CPU ops costs the host about a microsecond
per op, so the gaps read here are an upper bound of the unprofiled step's.

Used by ``hstu_pipelines.py --gaps N``.
"""

import bisect
import json
import os
import tempfile
from collections import defaultdict

import torch

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
WAITING_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cuStreamSynchronize",
    "cuCtxSynchronize",
)
TASK_RANGE = "task "
MIN_GAP_US = 2.0
"""Shorter idle intervals are the launch pipeline's own spacing between back-to-back kernels."""


def ranged_bodies(bodies: dict) -> dict:
    """The engine's task bodies, each inside a ``record_function`` range named after its task."""

    def ranged(name, body):
        def run(batch):
            with torch.profiler.record_function(f"{TASK_RANGE}{name}"):
                return body(batch)

        return run

    return {name: ranged(name, body) for name, body in bodies.items()}


def profile_trace(run, batches, device) -> list:
    """The chrome-trace events of ``run(batches)`` under torch.profiler (CPU and CUDA activities; the CPU ops
    of every thread, the engine's included: by default only the threads that entered the profiler)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(activities=activities, experimental_config=every_thread) as prof:
        run(batches)
        torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


class _Spans:
    """One host thread's profiler ranges (properly nested), for the ranges enclosing an instant."""

    def __init__(self, spans):
        self.spans = sorted(spans, key=lambda s: (s[0], -s[1]))
        self.starts = [s[0] for s in self.spans]

    def enclosing(self, ts, look_back=4000):
        """The spans containing ``ts``, outermost first."""
        i = bisect.bisect_right(self.starts, ts)
        found = [s for s in self.spans[max(0, i - look_back) : i] if s[1] >= ts]
        return sorted(found, key=lambda s: s[0])


def _launch_place(launch, threads, ops):
    """(thread, instant) at which to read the host ranges enclosing ``launch``: the launch's own, or where the
    trace files runtime calls under a thread id of their own, the op that made the call (its "External id")."""
    if launch is None:
        return None
    if launch["tid"] in threads:
        return launch["tid"], launch["ts"]
    op = ops.get(launch.get("args", {}).get("External id"))
    return None if op is None or op["tid"] not in threads else (op["tid"], op["ts"])


def idle_gaps(events: list, steps: int) -> dict:
    """Per step: GPU busy and idle ms, and the idle ms by (task, outermost op, kernel) and by cause."""
    gpu = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), e.get("args", {}).get("correlation"), e.get("name", ""))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES
    )
    launches, waits, spans, ops = {}, [], defaultdict(list), {}
    for e in events:
        if e.get("ph") != "X":
            continue
        category, args = e.get("cat"), e.get("args", {})
        if category in LAUNCH_CATEGORIES:
            if "correlation" in args:
                launches[args["correlation"]] = e
            if e.get("name") in WAITING_CALLS:
                waits.append((e["ts"] + e.get("dur", 0), e["name"], e["tid"]))
        elif category in ("cpu_op", "user_annotation"):
            spans[e["tid"]].append((e["ts"], e["ts"] + e.get("dur", 0), e["name"], category))
            if "External id" in args:
                ops[args["External id"]] = e
    threads = {tid: _Spans(s) for tid, s in spans.items()}
    waits.sort()
    wait_ends = [w[0] for w in waits]
    if not gpu:
        return {"busy_ms": 0.0, "idle_ms": 0.0, "by_place": [], "by_cause": []}
    by_place, by_cause = defaultdict(lambda: [0.0, 0]), defaultdict(lambda: [0.0, 0])
    busy = idle = 0.0
    run_start, run_end = gpu[0][0], gpu[0][1]
    for start, end, correlation, kernel in gpu[1:]:
        gap = start - run_end
        if gap <= MIN_GAP_US:
            run_end = max(run_end, end)
            continue
        busy += run_end - run_start
        idle += gap
        launch = launches.get(correlation)
        i = bisect.bisect_left(wait_ends, run_end)
        waited = waits[i] if i < len(waits) and waits[i][0] <= start else None
        task = op = "?"
        where = _launch_place(launch, threads, ops)
        if where is not None:
            enclosing = threads[where[0]].enclosing(where[1])
            tasks = [s[2] for s in enclosing if s[3] == "user_annotation" and s[2].startswith(TASK_RANGE)]
            ops = [s[2] for s in enclosing if s[3] == "cpu_op"]
            task = tasks[-1][len(TASK_RANGE) :] if tasks else "-"
            op = ops[0] if ops else "-"
        if waited is not None:
            cause = f"after {waited[1]}"
        elif launch is None:
            cause = "launch not recorded"
        elif launch["ts"] + launch.get("dur", 0) >= run_end:
            cause = "launched after the GPU ran dry"
        else:
            cause = "launched before the gap (queue or dependency)"
        for table, key in ((by_place, (task, op, kernel)), (by_cause, cause)):
            table[key][0] += gap
            table[key][1] += 1
        run_start, run_end = start, end
    busy += run_end - run_start

    def per_step(table):
        rows = [(key, ms / 1e3 / steps, count / steps) for key, (ms, count) in table.items()]
        return sorted(rows, key=lambda r: -r[1])

    return {
        "busy_ms": busy / 1e3 / steps,
        "idle_ms": idle / 1e3 / steps,
        "by_place": per_step(by_place),
        "by_cause": per_step(by_cause),
    }


def report_gaps(say, mode: str, gaps: dict, top: int) -> None:
    say(
        f"GPU idle between the kernels of '{mode}' per step (profiled: CPU ops recorded): "
        f"{gaps['idle_ms']:.2f} ms idle, {gaps['busy_ms']:.2f} ms busy; by cause:"
    )
    for cause, ms, count in gaps["by_cause"]:
        say(f"  {ms:8.3f} ms {count:7.1f}x  {cause}")
    say(f"  the {top} largest by task, outermost op at the launch, and the kernel that ended the gap:")
    for (task, op, kernel), ms, count in gaps["by_place"][:top]:
        say(f"  {ms:8.3f} ms {count:7.1f}x  {task:<16} {op[:40]:<40} {kernel[:70]}")
