"""Runs one mode of the user's path (``Trainer(strategy=HSTUPipelineStrategy(preset, capture_graphs=...))``)
on one GPU for long enough to attach a sampling profiler to it, and says when the steady state starts:

    python benchmarks/profile_user_path.py --workload light --preset default_d6 --graphs --steps 1500 &
    # when the file named by --ready appears: py-spy record --pid $(cat /tmp/profile_ready) --threads ...

The batches, model sizes and Trainer settings are those of ``hstu_pipelines.py``'s user's-path rows;
``--plain`` runs its plain loop instead (no Trainer), so that each mode can be timed alone in a process.
Without a GPU it runs on the CPU (gloo); ``--small`` takes ``hstu_pipelines.py --small``'s sizes."""

import argparse
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from hstu_pipelines import (
    SMALL,
    WORKLOADS,
    _Batches,
    build_model,
    cycled,
    make_batches,
    model_sizes,
    run_plain,
    user_path_trainer,
)

from lightning_hstu import HSTUPipelineStrategy
from lightning_hstu.models.hstu import HSTURecommender


class _Marks(pl.Callback):
    """Writes ``path`` after ``warmup`` steps and prints the ms/step of every ``every`` steps after it."""

    def __init__(self, warmup, every, path):
        self.warmup, self.every, self.path, self.start = warmup, every, Path(path), None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        done = batch_idx - self.warmup
        if done < 0 or done % self.every:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self.start is not None:
            print(f"steps {done - self.every}-{done}: {(now - self.start) * 1e3 / self.every:.2f} ms/step", flush=True)
        else:
            self.path.write_text(str(os.getpid()))
        self.start = now


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="light", choices=list(WORKLOADS))
    parser.add_argument("--preset", default="default_d6")
    parser.add_argument("--graphs", action="store_true")
    parser.add_argument("--lightning", action="store_true", help="Lightning's own loop (engine=False)")
    parser.add_argument("--plain", action="store_true", help="the benchmark's plain PyTorch loop, no Trainer")
    parser.add_argument("--on-nonfinite-loss", default="raise", help="HSTURecommender's on_nonfinite_loss")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--batches", type=int, default=110, help="distinct batches, cycled (the benchmark's 10 + 100)")
    parser.add_argument("--ready", default="/tmp/profile_ready")
    parser.add_argument("--small", action="store_true", help="hstu_pipelines.py's tiny sizes (for a CPU run)")
    args = parser.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29518")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    sizes = SMALL if args.small else WORKLOADS[args.workload]
    num_items = 1000 if args.small else 1_000_000
    batches = make_batches(args.batches, 32, sizes["max_len"], num_items, 16)
    total = args.warmup + args.steps
    if args.plain:
        _plain_loop(sizes, device, num_items, cycled(batches, total), _Marks(args.warmup, args.every, args.ready))
        dist.destroy_process_group()
        return
    model = HSTURecommender(
        **model_sizes(sizes),
        sparse_optimizer="sgd",
        lr=1e-4,
        balance_batches=True,
        on_nonfinite_loss=args.on_nonfinite_loss,
    )
    strategy = (
        HSTUPipelineStrategy(engine=False)
        if args.lightning
        else HSTUPipelineStrategy(preset=args.preset, capture_graphs=args.graphs, step_timeout=600)
    )
    trainer = user_path_trainer(strategy, device, total, [_Marks(args.warmup, args.every, args.ready)])
    trainer.fit(model, _Batches(cycled(batches, total), num_items))
    dist.destroy_process_group()


def _plain_loop(sizes, device, num_items, batches, marks):
    """``hstu_pipelines.py``'s plain loop (``run_plain``: same model, optimizer and autocast) over
    ``batches``, timed by ``marks`` as the Trainer's steps are."""
    model = build_model(sizes, device, num_items)
    optimizer = torch.optim.AdamW(model.objectives.parameters(), lr=1e-4)
    run_plain(model, optimizer, "cuda" if device.type == "cuda" else None)(_marked(batches, marks))


def _marked(batches, marks):
    for index, batch in enumerate(batches):
        marks.on_train_batch_start(None, None, batch, index)
        yield batch


if __name__ == "__main__":
    main()
