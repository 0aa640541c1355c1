"""Host cost of the engine itself, per step and per task, for every preset.

Every task body is trivial (it writes its slots), so what is measured is the engine: ring, slot views,
step barrier, thread hand-offs, waits, tickets and records. The baseline calls the same bodies in plan
order in a plain Python loop. Prints a table; the figure to read is "overhead us/task".

    python benchmarks/engine_overhead.py [--steps 2000] [--repeats 5] [--device cuda] [--presets ...]

With ``--device cuda`` the engine also does its CUDA work per task (each task under its plan stream,
events where another stream waits or where the task is a collective, waits and ``record_stream`` on
cross-stream edges); the bodies still launch nothing.
"""

import argparse
import platform
import statistics
import time

import torch

from lightning_hstu import PRESET_NAMES, Engine, get_plan


def trivial_bodies(plan):
    def body_for(writes):
        def body(batch):
            for slot in writes:
                batch[slot] = 1

        return body

    return {t.name: body_for(t.writes) for t in plan.tasks}


def plain_loop_s(plan, steps):
    bodies = [(body, t.reads) for t, body in zip(plan.tasks, trivial_bodies(plan).values())]
    start = time.perf_counter()
    for index in range(steps):
        slots = {"batch": index}
        for body, _ in bodies:
            body(slots)
    return time.perf_counter() - start


def engine_s(plan, steps, device=None):
    with Engine(plan, trivial_bodies(plan), device=device) as engine:
        engine.run(range(50))  # warm-up: threads started, templates cached
        start = time.perf_counter()
        engine.run(range(steps))
        return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default=None, help="the engine's device (cuda: its stream and event work)")
    parser.add_argument("--presets", nargs="+", default=PRESET_NAMES, choices=PRESET_NAMES)
    args = parser.parse_args()
    print(
        f"# {platform.node()}: {platform.processor() or platform.machine()}, "
        f"{__import__('os').cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"
    )
    print(
        f"# {args.steps} steps per run, median of {args.repeats} runs (spread = max - min), "
        f"device {args.device or 'none'}"
    )
    header = (
        f"{'preset':<24} {'threads':>7} {'plain us/step':>13} {'engine us/step':>14} {'spread':>7} "
        f"{'overhead us/task':>16}"
    )
    print(header)
    print("-" * len(header))
    for name in args.presets:
        plan = get_plan(name)
        plain = statistics.median(plain_loop_s(plan, args.steps) for _ in range(args.repeats))
        runs = [engine_s(plan, args.steps, args.device) for _ in range(args.repeats)]
        engine = statistics.median(runs)
        per_step = 1e6 / args.steps
        overhead = (engine - plain) * per_step / len(plan.tasks)
        print(
            f"{name:<24} {len(plan.threads):>7} {plain * per_step:>13.1f} {engine * per_step:>14.1f} "
            f"{(max(runs) - min(runs)) * per_step:>7.1f} {overhead:>16.1f}"
        )


if __name__ == "__main__":
    main()
