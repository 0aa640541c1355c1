"""The HSTU step without Lightning: engine bodies, a plain loop and TorchRec's pipeline over the same model
pieces (sharded embeddings, dense objectives, megatron-core gradients). For the comparisons of the tests
and the benchmarks; the Lightning path is ``models.hstu.HSTURecommender`` under the strategy."""

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from .batch import HSTUBatch
from .dense_grads import MegatronDenseGrads
from .graphs import GraphedMethod


def sparse_features(batch: HSTUBatch, sparse_keys: int = 4) -> KeyedJaggedTensor:
    """The keys the EmbeddingCollection embeds (the batch's first four: item, item_neg, action, user), as the
    batch holds them (``HSTURecommender.sparse_features`` puts the item table under item_neg for the full
    softmax)."""
    keys = batch.features.keys()
    return batch.features.split([sparse_keys, len(keys) - sparse_keys])[0]


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


def global_tokens(batch: HSTUBatch) -> torch.Tensor:
    """The token count of every rank's batch together, all-reduced; stays a tensor (no host sync)."""
    tokens = batch.sequence_lengths().sum().to(torch.float32)
    dist.all_reduce(tokens)
    return tokens


def global_token_scale(tokens: torch.Tensor) -> torch.Tensor:
    """Factor for a rank's summed loss so that the data-parallel mean over ranks is the loss of the whole
    global batch per token (``tokens``: the all-reduced token count)."""
    return dist.get_world_size() / tokens


def dense_losses(objectives: nn.Module, batch: HSTUBatch, embeddings,
                 graphed: GraphedMethod | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed retrieval and ranking losses; through ``graphed`` (``objectives.losses`` on inputs of
    static shapes: padded to the model's length, or jagged with a token capacity) when given."""
    if graphed is None:
        return objectives(batch, embeddings)
    return graphed(*objectives.dense_inputs(batch, embeddings, static=True))


def global_token_loss(objectives: nn.Module, batch: HSTUBatch, embeddings, tokens: torch.Tensor,
                      graphed: GraphedMethod | None = None) -> torch.Tensor:
    """The rank's loss, scaled by ``global_token_scale``."""
    retrieval, ranking = dense_losses(objectives, batch, embeddings, graphed)
    return (retrieval + ranking) * global_token_scale(tokens)


def engine_bodies(model: Any, optimizer: torch.optim.Optimizer, losses: list, *, autocast: str | None = None,
                  graphed: GraphedMethod | None = None):
    """Bodies for every task; ``model`` has the HSTURecommender hooks and parts (embeddings, objectives,
    dense_grads, shuffler). ``losses`` receives each batch's loss tensor (no host sync). With ``graphed``
    the forward goes through it (give the engine ``graphs={"forward": graphed}`` to capture it)."""
    def h2d(b):
        b["device_batch"] = b["batch"].to(_device(model), non_blocking=True)

    def zero_grad(b):
        model.dense_grads.zero_grad()
        b["grads_cleared"] = True

    def forward(b):
        with _autocast(autocast):  # thread-local: entered on the thread that runs forward
            b["loss"] = global_token_loss(model.objectives, b["shuffled_batch"], b["embeddings"], b["global_tokens"],
                                          graphed)

    def backward(b):
        b["loss"].backward()
        b["grads"] = True

    def optimizer_step(b):
        optimizer.step()  # the gradients were finalised by their own task
        b["stepped"] = True

    def watchdog(b):
        losses.append(b["loss"].detach())

    return {"h2d": h2d, "start_shuffle": model.hstu_start_shuffle, "finish_shuffle": model.hstu_finish_shuffle,
            "start_input_dist": model.hstu_start_input_dist, "wait_input_dist": model.hstu_wait_input_dist,
            "prefetch_embeddings": model.hstu_prefetch_embeddings, "zero_grad": zero_grad,
            "global_tokens_allreduce": model.hstu_global_tokens_allreduce,
            "compute_output_dist": model.hstu_compute_output_dist, "forward": forward, "backward": backward,
            "finalize_model_grads": model.hstu_finalize_model_grads, "optimizer_step": optimizer_step,
            "watchdog": watchdog}


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
