"""Fits the HSTU recommender on two processes, optionally checkpointing or resuming; run by
test_hstu_checkpoint.py (CPU processes, gloo) and test_two_gpus.py.

    python hstu_resume.py OUT_DIR MAX_STEPS [--save-every N] [--keep K] [--resume CKPT] [--devices N]
                          [--accelerator {cpu,gpu}] [--state-at STEP]
                          [--fail-lightning-file NAME | --kill-in-lightning-file NAME]

Each rank saves its dense weights, its shards of the embedding tables and of the fused optimizer's state,
the losses and the users of the batches of the steps it trained to OUT_DIR/rank<R>.pt. ``--state-at STEP``
adds the same state as it was when the global step was STEP: after that step, or when a resumed fit starts
there. With ``--accelerator gpu`` rank R trains on CUDA device R, over NCCL. ``--fail-lightning-file NAME``
makes rank 0's write of ``lightning.pt`` in the save of checkpoint NAME raise (a full disk);
``--kill-in-lightning-file`` ends the process there instead, half the file written (a killed job).
"""

import argparse
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_hstu import HSTUPipelineStrategy
from lightning_hstu.models.hstu import HSTURecommender

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' helpers
from small_hstu import model_and_data  # noqa: E402


class Losses(Callback):
    """Each trained batch's loss and users (which samples it held, on this rank after the shuffle)."""

    def __init__(self):
        self.losses, self.users = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.users.append(batch.features["user"].values().tolist())


class StateAt(Callback):
    """The model's state when the global step is ``step``: after that step, or where a resumed fit starts."""

    def __init__(self, step: int):
        self.step, self.state = step, None

    def on_train_start(self, trainer, pl_module):
        self._take(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._take(trainer, pl_module)

    def _take(self, trainer, pl_module):
        if trainer.global_step == self.step and self.state is None:
            self.state = state_of(pl_module)


def shards(state: dict) -> dict:
    """Plain tensors of a (possibly sharded) state dict: the local shard of each ShardedTensor, in host memory."""
    out = {}
    for name, value in state.items():
        if isinstance(value, dict):
            out.update({f"{name}.{k}": v for k, v in shards(value).items()})
        elif hasattr(value, "local_shards"):
            out[name] = value.local_shards()[0].tensor.detach().cpu().clone()
        elif isinstance(value, torch.Tensor):
            out[name] = value.detach().cpu().clone()
    return out


def state_of(model: HSTURecommender) -> dict:
    return {
        "model": shards(model.state_dict()),
        "sparse_optimizer": shards(model.embeddings.model_parallel.fused_optimizer.state_dict()["state"]),
    }


def inject_into_lightning_file(name: str, kill: bool) -> None:
    save = torch.save

    def failing_save(obj, f, *args, **kwargs):
        if not (str(f).endswith("lightning.pt") and f".{name}." in str(f)):
            return save(obj, f, *args, **kwargs)
        save(obj, f, *args, **kwargs)
        Path(f).write_bytes(Path(f).read_bytes()[: os.path.getsize(f) // 2])
        if kill:
            os._exit(9)
        raise OSError("no space left on device (injected)")

    torch.save = failing_save


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("max_steps", type=int)
    parser.add_argument("--save-every", type=int)
    parser.add_argument("--keep", type=int, default=-1, help="ModelCheckpoint's save_top_k")
    parser.add_argument("--resume")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--state-at", type=int)
    parser.add_argument("--fail-lightning-file")
    parser.add_argument("--kill-in-lightning-file")
    args = parser.parse_args()
    if args.fail_lightning_file or args.kill_in_lightning_file:
        inject_into_lightning_file(
            args.fail_lightning_file or args.kill_in_lightning_file, kill=bool(args.kill_in_lightning_file)
        )
    model_kwargs, data = model_and_data(args.accelerator)
    pl.seed_everything(0, verbose=False)
    model = HSTURecommender(**model_kwargs)
    recorder = Losses()
    state_at = StateAt(args.state_at)
    callbacks = [recorder, state_at]
    if args.save_every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.out_dir, every_n_train_steps=args.save_every, save_top_k=args.keep, filename="{step}"
            )
        )
    trainer = pl.Trainer(
        strategy=HSTUPipelineStrategy("default_d6"),
        accelerator=args.accelerator,
        devices=args.devices,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=bool(args.save_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    trainer.fit(model, data(), ckpt_path=args.resume)
    torch.save(
        {
            "state": state_of(model),
            "state_at": state_at.state,
            "losses": recorder.losses,
            "users": recorder.users,
            "global_step": trainer.global_step,
        },
        f"{args.out_dir}/rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
