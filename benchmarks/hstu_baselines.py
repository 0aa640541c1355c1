"""The HSTU step without Lightning, over the model's own pieces (sharded embeddings, dense objectives,
megatron-core gradients): engine bodies, a plain PyTorch loop step, and the model and batch TorchRec's
``TrainPipelineSparseDist`` runs. The baselines ``hstu_pipelines.py`` times and the tests compare the
strategy with; the Lightning path is ``lightning_hstu.models.hstu.HSTURecommender`` under the strategy."""

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from lightning_hstu.hstu.batch import HSTUBatch
from lightning_hstu.hstu.dense_grads import MegatronDenseGrads
from lightning_hstu.hstu.graphs import GraphedMethod
from lightning_hstu.hstu.step import global_token_loss, global_tokens, sparse_features
from lightning_hstu.hstu.tasks import HSTU_TASK_NAMES


class FinalizingOptimizer:
    """Wraps a dense optimizer so that zero_grad clears megatron-core's buffers and step all-reduces them
    first (TorchRec's pipeline calls only zero_grad and step)."""

    def __init__(self, optimizer: torch.optim.Optimizer, grads: MegatronDenseGrads):
        self.optimizer, self.grads = optimizer, grads

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grads.zero_grad()

    def step(self, closure=None):
        self.grads.finalize()
        return self.optimizer.step(closure)


def engine_bodies(
    model: Any,
    optimizer: torch.optim.Optimizer,
    losses: list,
    *,
    autocast: str | None = None,
    graphed: GraphedMethod | None = None,
    check_finite: bool = False,
):
    """Bodies for every task: the model's ``hstu_<task>`` methods, and the ones below for what Lightning does
    under the strategy. ``model`` has the HSTURecommender hooks and parts (embeddings, objectives,
    dense_grads, shuffler). ``losses`` receives each batch's loss tensor (no host sync). With ``graphed``
    the forward goes through it (give the engine ``graphs={"forward": graphed}`` to capture it). With
    ``check_finite`` the loss is checked as ``HSTURecommender(on_nonfinite_loss="stop")`` checks it on one
    rank: the forward keeps its finite flag on the device, and the watchdog reads it once the step's
    backward and optimizer step are queued (``FloatingPointError`` if it is not finite)."""

    finite_flags: dict[int, torch.Tensor] = {}  # check_finite: each batch's flag until the watchdog reads it

    def h2d(b):
        b["device_batch"] = b["batch"].to(_device(model), non_blocking=True)

    def zero_grad(b):
        model.dense_grads.zero_grad()
        b["grads_cleared"] = True

    def forward(b):
        with _autocast(autocast):  # thread-local: entered on the thread that runs forward
            loss = global_token_loss(
                model.objectives, b["shuffled_batch"], b["embeddings"], b["global_tokens"], graphed
            )
        b["loss"] = loss
        if check_finite:  # kept off the slots, as the model keeps it (the forward writes the loss only)
            finite_flags[b.index] = torch.isfinite(loss.detach())

    def backward(b):
        b["loss"].backward()
        b["grads"] = True

    def optimizer_step(b):
        optimizer.step()  # the gradients were finalised by their own task
        b["stepped"] = True

    def watchdog(b):
        losses.append(b["loss"].detach())
        if check_finite and not bool(finite_flags.pop(b.index)):
            raise FloatingPointError(f"non-finite loss at batch {b.index} (the step was applied)")

    own = {
        "h2d": h2d,
        "zero_grad": zero_grad,
        "forward": forward,
        "backward": backward,
        "optimizer_step": optimizer_step,
        "watchdog": watchdog,
    }
    return {name: own[name] if name in own else getattr(model, f"hstu_{name}") for name in HSTU_TASK_NAMES}


def plain_step(model: Any, optimizer: torch.optim.Optimizer, batch: HSTUBatch, *, autocast: str | None = None):
    """One step as a plain PyTorch loop does it, for the same pieces."""
    batch = batch.to(_device(model), non_blocking=True)
    tokens = global_tokens(batch)
    embeddings = model.embeddings(model.sparse_features(batch))
    model.dense_grads.zero_grad()
    with _autocast(autocast):
        loss = global_token_loss(model.objectives, batch, embeddings, tokens)
    loss.backward()
    model.dense_grads.finalize()
    optimizer.step()
    return loss.detach()


@dataclass
class PipelineBatch(Pipelineable):
    """What TorchRec's pipeline wants: the embedding features as an attribute it can trace."""

    sparse: KeyedJaggedTensor
    full: HSTUBatch

    @staticmethod
    def of(batch: HSTUBatch) -> "PipelineBatch":
        return PipelineBatch(sparse_features(batch), batch)

    def to(self, device, non_blocking=False):
        return PipelineBatch(self.sparse.to(device, non_blocking=non_blocking), self.full.to(device, non_blocking))

    def record_stream(self, stream):
        self.sparse.record_stream(stream)
        self.full.record_stream(stream)

    def pin_memory(self):
        return PipelineBatch(self.sparse.pin_memory(), self.full.pin_memory())


class PipelineModel(nn.Module):
    """The model TorchRec's ``TrainPipelineSparseDist`` runs: sharded embeddings, then the dense loss as
    one module that holds no sharded module (its tracer calls it as a leaf)."""

    def __init__(self, model: Any, autocast: str | None = None):
        super().__init__()
        self.sparse = model.embeddings.model_parallel
        self.loss = _DenseLoss(model.objectives, autocast)

    def forward(self, batch: PipelineBatch):
        loss = self.loss(batch.full, self.sparse(batch.sparse))
        return loss, loss.detach()


class _DenseLoss(nn.Module):
    def __init__(self, objectives: nn.Module, autocast: str | None):
        super().__init__()
        self.objectives, self.autocast = objectives, autocast

    def forward(self, batch: HSTUBatch, embeddings):
        tokens = global_tokens(batch)
        with _autocast(self.autocast):
            return global_token_loss(self.objectives, batch, embeddings, tokens)


def _device(model: Any) -> torch.device:
    return next(model.objectives.parameters()).device


def _autocast(device_type: str | None):
    return torch.autocast(device_type, dtype=torch.bfloat16) if device_type else contextlib.nullcontext()
