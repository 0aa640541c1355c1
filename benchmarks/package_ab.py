"""Times versions of the package beside each other on the user's path: each version runs
``profile_user_path.py`` in a process of its own, the versions in turns (round-robin, ``--rounds`` times), so
that a machine's drift over a lease falls on each alike; per process, the median of its windows.

    python benchmarks/package_ab.py 0b6be9d HEAD --rounds 3 -- --workload light --preset legacy_none --graphs \\
        --on-nonfinite-loss stop --batches 110 --warmup 300 --steps 700 --every 100

A version is a git revision (its ``lightning_hstu`` exported with ``git archive``), a directory holding a
``lightning_hstu`` package (a copy with a change under trial), ``plain`` (``profile_user_path.py --plain``
with the first version's package), ``lightning`` (``--lightning``, Lightning's own loop, the same package) or
``engine`` (``--engine``, ``Engine`` driven directly with the passed ``--preset``: the user's path minus it is
the strategy's own cost). Everything after ``--`` goes to ``profile_user_path.py``; a version followed by
``+`` and arguments gives that version's processes those arguments too (``main "main+--pin-python-threads
0"``: the same package with and without the option). ``--cpus 0-7`` pins every process to those cores.
Prints each round's ms/step per version, then per version the median
over rounds and, against the first version, each round's difference and in how many rounds it was faster.

With ``--thread-cpu`` among the passed arguments it also prints each process's CPU time per step of the
stepping thread (the engine's ``hstu-main``, or the plain loop's ``MainThread``) and of autograd's device
thread, and their ratio, and per version the medians of the three: where a change leaves autograd's work
alone, its CPU time shows how fast that process's CPU ran (it moves by 10-20% between processes of one lease
on the GPU machines), and the ratio compares the stepping thread's work across processes without that drift;
where a change moves work off or onto autograd's thread (the gradients added in the backward graph did), the
two threads' own medians compare, not the ratio. It prints all threads' CPU time per step too (every thread
``--thread-cpu`` lists: the caller's, the loader's, the engine's, autograd's), the host work of the whole
process, for the strategy's own cost: the user's path's total against the ``engine`` row's.
"""

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WINDOW = re.compile(r"steps \d+-\d+: ([0-9.]+) ms/step")
LOOPS = {"plain": "--plain", "lightning": "--lightning", "engine": "--engine"}
"""Versions that are another loop over the first version's package: their flag of ``profile_user_path.py``."""
THREAD_CPU = re.compile(r"^  (\S[^\n]*?)\s+([0-9.]+) ms/step$", re.MULTILINE)
"""A thread's line of ``profile_user_path.py --thread-cpu`` (every thread listed, 0.05 ms/step or more): its name
(the engine's by their Python names, autograd's device thread as ``pt_autograd_<n> (<id>)``) and CPU ms per step."""


def export(version: str, into: Path) -> Path:
    """The directory whose ``lightning_hstu`` is ``version``'s."""
    if version in LOOPS:
        return into
    if (Path(version) / "lightning_hstu").is_dir():
        return Path(version).resolve()
    target = into / version.replace("/", "_")
    target.mkdir()
    archive = subprocess.run(
        ["git", "archive", version, "lightning_hstu"], cwd=HERE.parent, capture_output=True, check=False
    )
    if archive.returncode:
        raise SystemExit(
            f"version {version!r}: neither a directory with lightning_hstu/ nor a git revision "
            f"({archive.stderr.decode().strip()})"
        )
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


def cores(spec: str | None) -> set[int] | None:
    if not spec:
        return None
    out = set()
    for part in spec.split(","):
        low, _, high = part.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return out


def run(
    package: Path, loop: str | None, args: list[str], cpus: set[int] | None
) -> tuple[float, str, tuple[float, float, float] | None]:
    """One process of ``profile_user_path.py``: the median of its windows' ms/step, the windows, and (with
    ``--thread-cpu``) the stepping thread's, autograd's thread's and all threads' CPU ms per step, else None."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(HERE / "profile_user_path.py"), *args, *([loop] if loop else [])]
    result = subprocess.run(
        command,
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )
    windows = [float(m) for m in WINDOW.findall(result.stdout)]
    if result.returncode or not windows:
        raise SystemExit(f"{' '.join(command)} (PYTHONPATH {package}) failed:\n{result.stderr[-3000:]}")
    described, threads = " ".join(f"{w:.2f}" for w in windows), None
    block = result.stdout.partition("threads' CPU time")[2]  # empty without --thread-cpu
    cpu = {
        ("autograd" if name.startswith("pt_autograd") else name): float(ms) for name, ms in THREAD_CPU.findall(block)
    }
    stepping = cpu.get("hstu-main", cpu.get("MainThread"))
    if stepping is not None and cpu.get("autograd"):
        total = sum(cpu.values())
        threads = (stepping, cpu["autograd"], total)
        described += f"; CPU ms/step: stepping thread {stepping:.2f}, autograd {cpu['autograd']:.2f}, ratio "
        described += f"{stepping / cpu['autograd']:.2f}, all threads {total:.2f}"
    return statistics.median(windows), described, threads


def main() -> None:
    argv = sys.argv[1:]
    passed = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="+", help="git revisions, package directories, or plain")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpus", help="pin the processes to these cores, e.g. 0-7")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    specs = {v: (v.partition("+")[0], shlex.split(v.partition("+")[2])) for v in args.versions}
    if specs[args.versions[0]][0] in LOOPS:
        raise SystemExit(
            f"the first version is the baseline and gives {args.versions[0]} its package: name a revision first"
        )
    pinned = cores(args.cpus)
    with tempfile.TemporaryDirectory() as scratch:
        packages = {}
        for base, _ in specs.values():
            if base not in packages and base not in LOOPS:
                packages[base] = export(base, Path(scratch))
        packages.update({loop: packages[specs[args.versions[0]][0]] for loop in LOOPS})
        medians: dict[str, list[float]] = {v: [] for v in args.versions}
        threads: dict[str, list[tuple[float, float, float]]] = {v: [] for v in args.versions}
        for round_ in range(1, args.rounds + 1):
            for version in args.versions:
                base, extra = specs[version]
                median, windows, cpu = run(packages[base], LOOPS.get(base), passed + extra, pinned)
                medians[version].append(median)
                if cpu is not None:
                    threads[version].append(cpu)
                print(f"round {round_} {version:>14}: {median:6.2f} ms/step  (windows {windows})", flush=True)
    base = medians[args.versions[0]]
    print("\nmedian over rounds, and against the first version round by round:")
    for version, values in medians.items():
        deltas = [v - b for v, b in zip(values, base)]
        faster = sum(d < 0 for d in deltas)
        line = f"{version:>14}: {statistics.median(values):6.2f} ms/step"
        if version != args.versions[0]:
            line += f"  ({', '.join(f'{d:+.2f}' for d in deltas)}; faster in {faster} of {len(deltas)})"
        if threads[version]:
            stepping, autograd, total = zip(*threads[version])
            ratios = [s / a for s, a, _ in threads[version]]
            line += f"; CPU ms/step medians: stepping {statistics.median(stepping):.2f}, autograd "
            line += f"{statistics.median(autograd):.2f}, ratio {statistics.median(ratios):.2f}"
            line += f" ({', '.join(f'{r:.2f}' for r in ratios)}), all threads {statistics.median(total):.2f}"
        print(line)


if __name__ == "__main__":
    main()
