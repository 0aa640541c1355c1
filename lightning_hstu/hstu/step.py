"""The pieces of one HSTU training step that every way of running it shares: the features the embeddings
look up, the global token count and the loss normalised by it. ``models.hstu.HSTURecommender`` builds its
tasks and ``training_step`` from them; the baselines of the tests and benchmarks (``benchmarks/
hstu_baselines.py``: a plain loop, TorchRec's pipeline) use the same ones."""

import torch
import torch.distributed as dist
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from .batch import HSTUBatch
from .graphs import GraphedMethod


def sparse_features(batch: HSTUBatch, sparse_keys: int = 4) -> KeyedJaggedTensor:
    """The keys the EmbeddingCollection embeds (the batch's first four: item, item_neg, action, user), as the
    batch holds them (``HSTURecommender.sparse_features`` puts the item table under item_neg for the full
    softmax)."""
    keys = batch.features.keys()
    return batch.features.split([sparse_keys, len(keys) - sparse_keys])[0]


def global_tokens(batch: HSTUBatch) -> torch.Tensor:
    """The token count of every rank's batch together, all-reduced; stays a tensor (no host sync)."""
    tokens = batch.sequence_lengths().sum().to(torch.float32)
    dist.all_reduce(tokens)
    return tokens


def global_token_scale(tokens: torch.Tensor) -> torch.Tensor:
    """Factor for a rank's summed loss so that the data-parallel mean over ranks is the loss of the whole
    global batch per token (``tokens``: the all-reduced token count)."""
    return dist.get_world_size() / tokens


def dense_losses(
    objectives: nn.Module, batch: HSTUBatch, embeddings, graphed: GraphedMethod | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed retrieval and ranking losses; through ``graphed`` (``objectives.losses`` on inputs of
    static shapes: padded to the model's length, or jagged with a token capacity) when given."""
    if graphed is None:
        return objectives(batch, embeddings)
    return graphed(*objectives.dense_inputs(batch, embeddings, static=True))


def global_token_loss(
    objectives: nn.Module, batch: HSTUBatch, embeddings, tokens: torch.Tensor, graphed: GraphedMethod | None = None
) -> torch.Tensor:
    """The rank's loss, scaled by ``global_token_scale``, as ``HSTURecommender.training_step`` computes it."""
    retrieval, ranking = dense_losses(objectives, batch, embeddings, graphed)
    return (retrieval + ranking) * global_token_scale(tokens)
