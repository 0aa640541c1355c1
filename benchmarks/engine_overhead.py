"""Host cost of the engine itself, per step and per task, for every preset.

Every task body is trivial (it writes its slots), so what is measured is the engine: ring, slot views,
step barrier, thread hand-offs, waits, tickets and records. The baseline calls the same bodies in plan
order in a plain Python loop. Prints a table; the figure to read is "overhead us/task".

    python benchmarks/engine_overhead.py [--steps 2000] [--repeats 5] [--device cuda] [--presets ...]

With ``--device cuda`` the engine also does its CUDA work per task (each task under its plan stream,
events where another stream waits or where the task is a collective, waits and ``record_stream`` on
cross-stream edges); the bodies still launch nothing.

``--step-timeout S`` runs the engine as the strategy does by default (a watchdog, the tasks on worker
threads and the batches pulled on the loader thread); ``--loader-ms`` makes each batch's ``next()`` take
that long and ``--forward-ms`` the forward task, both as a sleep (which releases the GIL, as a read from
disk or a wait for the device does): a loader that works while the step runs costs the step
``max(loader, step)``, one pulled between the steps ``loader + step``.
"""

import argparse
import platform
import statistics
import time

import torch

from lightning_hstu import PRESET_NAMES, Engine, get_plan


def trivial_bodies(plan, forward_s: float = 0.0):
    def body_for(writes, sleep_s):
        def body(batch):
            if sleep_s:
                time.sleep(sleep_s)
            for slot in writes:
                batch[slot] = 1

        return body

    return {t.name: body_for(t.writes, forward_s if t.name == "forward" else 0.0) for t in plan.tasks}


def slow_batches(count: int, loader_s: float):
    for index in range(count):
        if loader_s:
            time.sleep(loader_s)
        yield index


def plain_loop_s(plan, steps, loader_s=0.0, forward_s=0.0):
    bodies = [(body, t.reads) for t, body in zip(plan.tasks, trivial_bodies(plan, forward_s).values())]
    start = time.perf_counter()
    for index in slow_batches(steps, loader_s):
        slots = {"batch": index}
        for body, _ in bodies:
            body(slots)
    return time.perf_counter() - start


def engine_s(plan, steps, device=None, step_timeout=None, loader_s=0.0, forward_s=0.0):
    with Engine(plan, trivial_bodies(plan, forward_s), device=device, step_timeout=step_timeout) as engine:
        engine.run(range(50))  # warm-up: threads started, templates cached
        start = time.perf_counter()
        engine.run(slow_batches(steps, loader_s))
        return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default=None, help="the engine's device (cuda: its stream and event work)")
    parser.add_argument("--presets", nargs="+", default=PRESET_NAMES, choices=PRESET_NAMES)
    parser.add_argument("--step-timeout", type=float, default=None, help="as the strategy's (default there: 600)")
    parser.add_argument("--loader-ms", type=float, default=0.0, help="each batch's next() sleeps this long")
    parser.add_argument("--forward-ms", type=float, default=0.0, help="the forward task sleeps this long")
    args = parser.parse_args()
    loader_s, forward_s = args.loader_ms / 1e3, args.forward_ms / 1e3
    print(
        f"# {platform.node()}: {platform.processor() or platform.machine()}, "
        f"{__import__('os').cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"
    )
    print(
        f"# {args.steps} steps per run, median of {args.repeats} runs (spread = max - min), "
        f"device {args.device or 'none'}, step timeout {args.step_timeout}, loader {args.loader_ms:g} ms per "
        f"batch, forward {args.forward_ms:g} ms"
    )
    header = (
        f"{'preset':<24} {'threads':>7} {'plain us/step':>13} {'engine us/step':>14} {'spread':>7} "
        f"{'overhead us/task':>16}"
    )
    print(header)
    print("-" * len(header))
    for name in args.presets:
        plan = get_plan(name)
        plain = statistics.median(plain_loop_s(plan, args.steps, loader_s, forward_s) for _ in range(args.repeats))
        runs = [
            engine_s(plan, args.steps, args.device, args.step_timeout, loader_s, forward_s) for _ in range(args.repeats)
        ]
        engine = statistics.median(runs)
        per_step = 1e6 / args.steps
        overhead = (engine - plain) * per_step / len(plan.tasks)
        print(
            f"{name:<24} {len(plan.threads):>7} {plain * per_step:>13.1f} {engine * per_step:>14.1f} "
            f"{(max(runs) - min(runs)) * per_step:>7.1f} {overhead:>16.1f}"
        )


if __name__ == "__main__":
    main()
