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
per op, so the gaps read here are an upper bound of the unprofiled step's. The same trace (recorded with the
ops' input sizes and strides) gives each matrix product's kernel time and rate by kernel, sizes and strides:
which of the step's products run below what cuBLAS gives the same sizes alone (``gemm_shapes.py``).

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
    "cudaFree",  # the caching allocator returning memory (waits for the device)
    "cuStreamSynchronize",
    "cuCtxSynchronize",
)
TASK_RANGE = "task "
WINDOW_RANGE = "measured window"
"""The ``record_function`` range ``profile_trace`` opens around the profiled run and its closing synchronize."""
MIN_GAP_US = 2.0
"""Shorter idle intervals are the launch pipeline's own spacing between back-to-back kernels."""
GEMM_OPS = ("aten::mm", "aten::addmm")
TOKEN_DIM = 4096
"""In the matrix products' table, sizes above this are the token count (it changes from batch to batch) and
read "T", so that one layer's product at every batch is one row."""


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
    with torch.profiler.profile(activities=activities, experimental_config=every_thread, record_shapes=True) as prof:
        with torch.profiler.record_function(WINDOW_RANGE):
            run(batches)
            torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


def _stacks(spans: list, instants: list) -> list:
    """For each instant (ascending), the spans of one host thread open at it, outermost first: one sweep
    over the spans sorted by start (properly nested on a thread)."""
    spans = sorted(spans, key=lambda s: (s[0], -s[1]))
    stack, out, i = [], [], 0
    for instant in instants:
        while i < len(spans) and spans[i][0] <= instant:
            while stack and stack[-1][1] < spans[i][0]:
                stack.pop()
            stack.append(spans[i])
            i += 1
        while stack and stack[-1][1] < instant:
            stack.pop()
        out.append(list(stack))
    return out


def _places(gpu: list, launches: dict, spans: dict) -> list:
    """Per GPU event (as ``gpu`` orders them): (task, outermost op, innermost op, the innermost op's trace
    arguments) open on the host where its launch was made, "?" where the trace does not say."""
    queries = defaultdict(list)
    for index, (_, _, correlation, _) in enumerate(gpu):
        launch = launches.get(correlation)
        if launch is not None and launch["tid"] in spans:
            queries[launch["tid"]].append((launch["ts"], index))
    places = [("?", "?", "?", {})] * len(gpu)
    for tid, asked in queries.items():
        asked.sort()
        for (_, index), stack in zip(asked, _stacks(spans[tid], [instant for instant, _ in asked])):
            tasks = [s[2] for s in stack if s[3] == "user_annotation" and s[2].startswith(TASK_RANGE)]
            cpu_ops = [s for s in stack if s[3] == "cpu_op"]
            places[index] = (
                tasks[-1][len(TASK_RANGE) :] if tasks else "-",
                cpu_ops[0][2] if cpu_ops else "-",
                cpu_ops[-1][2] if cpu_ops else "-",
                cpu_ops[-1][4] if cpu_ops else {},
            )
    return places


def idle_gaps(events: list, steps: int) -> dict:
    """Per step: GPU busy and idle ms, the idle ms by (task, outermost op, kernel) and by cause, and each
    kernel's ms and launches by the host ops that launched it (kernel, outermost op, innermost op); the matrix
    products' ms, launches and TFLOP/s by (kernel, op, sizes, strides) (``gemms``). Per
    window (where the trace holds ``WINDOW_RANGE``): ``lead_ms`` from the window's start to its first GPU
    event (the host's work before the GPU gets any, e.g. an engine filling its lookahead), with the place
    that launched that event (``lead_place``), and ``tail_ms`` from the last GPU event's end to the window's
    end; None without the range."""
    gpu = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), e.get("args", {}).get("correlation"), e.get("name", ""))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES
    )
    launches, waits, spans = {}, [], defaultdict(list)
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
            spans[e["tid"]].append((e["ts"], e["ts"] + e.get("dur", 0), e["name"], category, args))
    if not gpu:
        return {"busy_ms": 0.0, "idle_ms": 0.0, "by_place": [], "by_cause": [], "launchers": []}
    places = _places(gpu, launches, dict(spans))
    windows = [s for thread in spans.values() for s in thread if s[2] == WINDOW_RANGE]
    lead = tail = None
    if windows:
        window_start, window_end = windows[0][0], windows[0][1]
        lead = (gpu[0][0] - window_start) / 1e3
        tail = (window_end - max(end for _, end, _, _ in gpu)) / 1e3
    waits.sort()
    wait_ends = [w[0] for w in waits]
    by_place, by_cause, launchers = (defaultdict(lambda: [0.0, 0]) for _ in range(3))
    gemms = defaultdict(lambda: [0.0, 0, 0.0])  # us, launches, FLOP
    for (start, end, _, kernel), (_, outer, inner, args) in zip(gpu, places):
        launchers[(kernel, outer, inner)][0] += end - start
        launchers[(kernel, outer, inner)][1] += 1
        if inner in GEMM_OPS and args.get("Input Dims"):
            key, flop = _gemm(kernel, inner, args)
            gemms[key][0] += end - start
            gemms[key][1] += 1
            gemms[key][2] += flop
    busy = idle = 0.0
    run_start, run_end = gpu[0][0], gpu[0][1]
    for (start, end, correlation, kernel), (task, outer, _, _) in zip(gpu[1:], places[1:]):
        gap = start - run_end
        if gap <= MIN_GAP_US:
            run_end = max(run_end, end)
            continue
        busy += run_end - run_start
        idle += gap
        launch = launches.get(correlation)
        i = bisect.bisect_left(wait_ends, run_end)
        if i < len(waits) and waits[i][0] <= start:
            cause = f"after {waits[i][1]}"
        elif launch is None:
            cause = "launch not recorded"
        elif launch["ts"] + launch.get("dur", 0) >= run_end:
            cause = "launched after the GPU ran dry"
        else:
            cause = "launched before the gap (queue or dependency)"
        for table, key in ((by_place, (task, outer, kernel)), (by_cause, cause)):
            table[key][0] += gap
            table[key][1] += 1
        run_start, run_end = start, end
    busy += run_end - run_start

    def per_step(table):
        rows = [(key, ms / 1e3 / steps, count / steps) for key, (ms, count) in table.items()]
        return sorted(rows, key=lambda r: -r[1])

    return {
        "lead_ms": lead,
        "lead_place": places[0],
        "tail_ms": tail,
        "busy_ms": busy / 1e3 / steps,
        "idle_ms": idle / 1e3 / steps,
        "by_place": per_step(by_place),
        "by_cause": per_step(by_cause),
        "launchers": per_step(launchers),
        "gemms": sorted(
            (
                (key, us / 1e3 / steps, count / steps, flop / us / 1e6 if us else 0.0)
                for key, (us, count, flop) in gemms.items()
            ),
            key=lambda r: -r[1],
        ),
    }


def _gemm(kernel: str, op: str, args: dict) -> tuple[tuple, float]:
    """A matrix product's row key (kernel, op, input sizes with the token count as "T", input strides) and
    its FLOP, from its op's recorded sizes (``aten::addmm``'s first input is the bias)."""
    dims = args["Input Dims"]
    a, b = (dims[1], dims[2]) if op == "aten::addmm" else (dims[0], dims[1])
    flop = 2.0 * a[0] * a[1] * b[1] if len(a) == 2 and len(b) == 2 else 0.0

    def text(sizes):
        return "x".join("T" if n > TOKEN_DIM else str(n) for n in sizes)

    strides = args.get("Input Strides") or []
    return (kernel, op, " ".join(text(d) for d in dims if d), " ".join(str(tuple(x)) for x in strides if x)), flop


def report_gaps(say, mode: str, gaps: dict, top: int) -> None:
    say(
        f"GPU idle between the kernels of '{mode}' per step (profiled: CPU ops recorded): "
        f"{gaps['idle_ms']:.2f} ms idle, {gaps['busy_ms']:.2f} ms busy; by cause:"
    )
    for cause, ms, count in gaps["by_cause"]:
        say(f"  {ms:8.3f} ms {count:7.1f}x  {cause}")
    if gaps.get("lead_ms") is not None:
        task, op, _, _ = gaps["lead_place"]
        say(
            f"  per window: {gaps['lead_ms']:.2f} ms before its first GPU event (launched in task {task}, op "
            f"{op[:40]}), {gaps['tail_ms']:.2f} ms after its last"
        )
    say(f"  the {top} largest by task, outermost op at the launch, and the kernel that ended the gap:")
    for (task, op, kernel), ms, count in gaps["by_place"][:top]:
        say(f"  {ms:8.3f} ms {count:7.1f}x  {task:<16} {op[:40]:<40} {kernel[:70]}")
    say(f"GPU kernels of '{mode}' by the host ops that launched them (outermost > innermost), the {top} largest:")
    for (kernel, outer, inner), ms, count in gaps["launchers"][:top]:
        say(f"  {ms:8.3f} ms {count:7.1f}x  {kernel[:60]:<60} <- {outer[:40]} > {inner[:40]}")
    if gaps.get("gemms"):
        say(f"the matrix products of '{mode}' by kernel and input sizes (T: the token count) and strides, per step:")
        for (kernel, op, sizes, strides), ms, count, rate in gaps["gemms"][:top]:
            say(f"  {ms:8.3f} ms {count:6.1f}x {rate:6.0f} TFLOP/s  {kernel[:52]:<52} {op} [{sizes}] strides {strides}")
