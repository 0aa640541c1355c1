"""Checkpoints of modules with sharded tables, through torch.distributed.checkpoint (DCP).

TorchRec's sharded tables appear in ``state_dict()`` as ``ShardedTensor``s: every rank holds other rows,
so rank 0 alone cannot write them, and ``torch.load`` cannot read them back. A checkpoint of such a
module is therefore a directory: DCP writes each rank's shards of every entry of the Lightning checkpoint
that holds a sharded tensor (the module's ``state_dict``, the fused sparse optimizer's state), and rank 0
writes the rest (loops, dense optimizer, callbacks, hyper-parameters) to ``lightning.pt`` beside them.
On load DCP reads the shards into the live tensors of the running module, laid out as the current ranks
shard them, which need not be how the saving ranks did.
"""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

LIGHTNING_FILE = "lightning.pt"
"""The entries without sharded tensors, written by rank 0 alone."""
SHARDED_KEYS = "hstu_sharded_keys"
"""Which entries of the checkpoint DCP holds (recorded in ``LIGHTNING_FILE``)."""


def holds_sharded(value: Any) -> bool:
    """Whether ``value`` (a tensor or nested dicts/lists of them) contains a sharded tensor."""
    if isinstance(value, (ShardedTensor, DTensor)):
        return True
    if isinstance(value, dict):
        return any(holds_sharded(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_sharded(v) for v in value)
    return False


def is_sharded_checkpoint(path: str | Path) -> bool:
    return (Path(path) / LIGHTNING_FILE).is_file()


def save(checkpoint: dict[str, Any], path: str | Path, is_global_zero: bool) -> None:
    """Every rank calls this (DCP's save is a collective); Trainer.save_checkpoint puts the barrier after
    it that makes the checkpoint complete on every rank."""
    path = Path(path)
    sharded = {key: value for key, value in checkpoint.items() if holds_sharded(value)}
    dcp.save(sharded, checkpoint_id=path)
    if is_global_zero:
        rest = {key: value for key, value in checkpoint.items() if key not in sharded}
        rest[SHARDED_KEYS] = sorted(sharded)
        torch.save(rest, path / LIGHTNING_FILE)


def load(path: str | Path, template: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The whole checkpoint; ``template()`` gives the current checkpoint (Lightning's dump of the running
    trainer), whose sharded entries DCP fills in place with the saved values."""
    path = Path(path)
    checkpoint = torch.load(path / LIGHTNING_FILE, weights_only=False)
    keys = checkpoint.pop(SHARDED_KEYS)
    current = template()
    missing = [key for key in keys if key not in current]
    if missing:
        raise KeyError(f"checkpoint {path} holds sharded entries {missing} that the running module does not "
                       f"produce (its checkpoint has: {', '.join(sorted(current))})")
    sharded = {key: current[key] for key in keys}
    dcp.load(sharded, checkpoint_id=path)
    checkpoint.update(sharded)
    return checkpoint
