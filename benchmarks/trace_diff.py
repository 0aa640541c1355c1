"""Two modes' traces from ``profile_user_path.py --trace`` side by side: what one does per step that the other
does not.

    python benchmarks/trace_diff.py user.json.counts.json engine.json.counts.json
    python benchmarks/trace_diff.py user.json engine.json --steps 20 20   # traces written with --trace-stacks

Given the ``.counts.json`` files: every op and CUDA runtime call whose count or self CPU time per step differs,
summed over each process's threads, largest difference in time first. Given the Chrome traces recorded with
``--trace-stacks`` (and the steps each covers, ``--trace-steps``): the Python calls per step of each thread,
then, for the busiest threads paired by their rank in calls (the two processes' thread ids differ), the
functions called more often in the first than in the second, and the other way round. A trace counts calls;
it does not time them (with frames recorded, the light step runs 4-5 times slower).
"""

import argparse
import collections
import json
import re

ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def summed_counts(path: str) -> dict[str, tuple[float, float]]:
    """Per op or runtime call: its count and self CPU us per step, over all threads."""
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for ops in json.load(open(path)).values():
        for name, (count, us) in ops.items():
            totals[name][0] += count
            totals[name][1] += us
    return {name: (count, us) for name, (count, us) in totals.items()}


def python_calls(path: str, steps: float) -> dict[int, collections.Counter]:
    """Per thread id: the Python functions called, per step (the frames of a ``with_stack`` trace)."""
    per_thread: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for event in json.load(open(path))["traceEvents"]:
        if event.get("ph") == "X" and event.get("cat") == "python_function":
            name = ADDRESS.sub("", event["name"].split("site-packages/")[-1])
            per_thread[event["tid"]][name] += 1
    return {tid: collections.Counter({k: v / steps for k, v in calls.items()}) for tid, calls in per_thread.items()}


def compare_counts(a: str, b: str, rows: int) -> None:
    first, second = summed_counts(a), summed_counts(b)
    print(f"per step, all threads: {sum(c for c, _ in first.values()):.0f} ops and runtime calls in {a}, ", end="")
    print(f"{sum(c for c, _ in second.values()):.0f} in {b}")
    print(f"{'d us':>8} {'d calls':>8} {'calls':>8} {'calls':>8}  name")
    names = sorted(set(first) | set(second), key=lambda n: -abs(first.get(n, (0, 0))[1] - second.get(n, (0, 0))[1]))
    for name in names[:rows]:
        (ca, ua), (cb, ub) = first.get(name, (0.0, 0.0)), second.get(name, (0.0, 0.0))
        print(f"{ua - ub:8.0f} {ca - cb:8.2f} {ca:8.2f} {cb:8.2f}  {name[:100]}")


def compare_traces(a: str, b: str, steps: tuple[float, float], threads: int, rows: int) -> None:
    first, second = python_calls(a, steps[0]), python_calls(b, steps[1])
    ranked = []  # each trace's thread ids, most calls first
    for path, calls in ((a, first), (b, second)):
        ranked.append(sorted(calls, key=lambda tid: -sum(calls[tid].values())))
        each = ", ".join(f"{tid}: {sum(calls[tid].values()):.0f}" for tid in ranked[-1])
        print(f"Python calls per step by thread in {path}: {each}")
    for rank, (ta, tb) in enumerate(zip(*ranked)):
        if rank >= threads:
            break
        ca, cb = first[ta], second[tb]
        print(f"\nthread {ta} against {tb} (the {rank + 1}. busiest): {sum(ca.values()) - sum(cb.values()):+.0f} calls")
        names = sorted(set(ca) | set(cb), key=lambda n: -(ca[n] - cb[n]))
        shown = names[:rows] + names[max(rows, len(names) - 5) :]  # the most called more, then the most called less
        for name in shown:
            print(f"{ca[name] - cb[name]:8.1f} {ca[name]:8.1f} {cb[name]:8.1f}  {name[:100]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("--steps", type=float, nargs=2, help="the steps each trace covers (traces with frames)")
    parser.add_argument("--threads", type=int, default=2, help="the busiest threads to pair and compare")
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    if args.first.endswith(".counts.json") and args.second.endswith(".counts.json"):
        compare_counts(args.first, args.second, args.rows)
    elif args.steps is None:
        parser.error("traces with frames need --steps A B (each trace's --trace-steps)")
    else:
        compare_traces(args.first, args.second, tuple(args.steps), args.threads, args.rows)


if __name__ == "__main__":
    main()
