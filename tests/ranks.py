"""Running a function on several gloo ranks (processes) in a test, and launching multi-process commands."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Set in the test process by single-process DDP fits; a new multi-process launch must not inherit them.
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK",
                    "GROUP_RANK", "LOCAL_WORLD_SIZE", "PL_GLOBAL_SEED", "PL_SEED_WORKERS")


def launch_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}


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
