"""Running a function on several gloo ranks (processes) in a test, and launching multi-process commands."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Set in the test process by single-process DDP fits; a new multi-process launch must not inherit them.
LAUNCH_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
)


def launch_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}


def run_script(script: Path, cwd: Path, *args, timeout: float) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS...`` in ``cwd``, as a new multi-process launch (see ``launch_env``); its output is
    captured. Past ``timeout`` seconds every process of the launch is killed (the ranks a launcher started too,
    which would otherwise outlive it holding their devices) and the test fails with the end of the output."""
    process = subprocess.Popen(
        [sys.executable, str(script), *map(str, args)],
        cwd=cwd,
        env=launch_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(
            f"{script.name} {' '.join(map(str, args))} did not end within {timeout:g} s; "
            f"its output ends:\n{stderr[-3000:]}"
        ) from None
    except BaseException:  # KeyboardInterrupt: in a session of their own the ranks would not get it
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def run_on_ranks(fn, tmp_path, world: int = 2) -> list:
    """``fn(rank, world)`` on ``world`` processes joined in a gloo group; returns each rank's result."""
    out = tmp_path / "ranks.pt"
    mp.spawn(_rank_main, args=(world, str(tmp_path / "init"), str(out), fn), nprocs=world, join=True)
    return torch.load(out, weights_only=False)


def _rank_main(rank, world, init_file, out, fn):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = fn(rank, world)
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            torch.save(gathered, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Done and saved: leave without the interpreter's teardown. A native thread that a library leaves joinable
    # until its static destructors run aborted one rank once that way (SIGABRT, "terminate called without an
    # active exception") after its result was saved. Errors above still propagate to mp.spawn as tracebacks.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
