"""Fits the HSTU recommender on two CPU processes (gloo), optionally checkpointing or resuming; run by
test_hstu_checkpoint.py.

    python hstu_resume.py OUT_DIR MAX_STEPS [--save-every N] [--keep K] [--resume CKPT] [--devices N]
                          [--fail-lightning-file NAME | --kill-in-lightning-file NAME]

Each rank saves its dense weights, its shards of the embedding tables and of the fused optimizer's state,
and the losses of the steps it trained to OUT_DIR/rank<R>.pt. ``--fail-lightning-file NAME`` makes rank 0's
write of ``lightning.pt`` in the save of checkpoint NAME raise (a full disk); ``--kill-in-lightning-file``
ends the process there instead, half the file written (a killed job).
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
from small_hstu import SMALL_MODEL, small_data  # noqa: E402


class Losses(Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def shards(state: dict) -> dict:
    """Plain tensors of a (possibly sharded) state dict: the local shard of each ShardedTensor."""
    out = {}
    for name, value in state.items():
        if isinstance(value, dict):
            out.update({f"{name}.{k}": v for k, v in shards(value).items()})
        elif hasattr(value, "local_shards"):
            out[name] = value.local_shards()[0].tensor.clone()
        elif isinstance(value, torch.Tensor):
            out[name] = value.clone()
    return out


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
    parser.add_argument("--fail-lightning-file")
    parser.add_argument("--kill-in-lightning-file")
    args = parser.parse_args()
    if args.fail_lightning_file or args.kill_in_lightning_file:
        inject_into_lightning_file(args.fail_lightning_file or args.kill_in_lightning_file,
                                   kill=bool(args.kill_in_lightning_file))
    pl.seed_everything(0, verbose=False)
    model = HSTURecommender(**SMALL_MODEL)
    recorder = Losses()
    callbacks = [recorder]
    if args.save_every:
        callbacks.append(ModelCheckpoint(dirpath=args.out_dir, every_n_train_steps=args.save_every,
                                         save_top_k=args.keep,
                                         filename="{step}"))
    trainer = pl.Trainer(strategy=HSTUPipelineStrategy("default_d6"), accelerator="cpu", devices=args.devices,
                         max_steps=args.max_steps, logger=False, enable_checkpointing=bool(args.save_every),
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=callbacks)
    data = small_data()
    trainer.fit(model, data, ckpt_path=args.resume)
    state = {"model": shards(model.state_dict()),
             "sparse_optimizer": shards(model.embeddings.model_parallel.fused_optimizer.state_dict()["state"])}
    torch.save({"state": state, "losses": recorder.losses, "global_step": trainer.global_step},
               f"{args.out_dir}/rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
