"""The pieces of one HSTU training step that every way of running it shares: the features the embeddings
look up, the global token count and the loss normalised by it. ``models.hstu.HSTURecommender`` builds its
tasks and ``training_step`` from them; the baselines of the tests and benchmarks (``benchmarks/
hstu_baselines.py``: a plain loop, TorchRec's pipeline) use the same ones."""

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from .batch import HSTUBatch
from .graphs import GraphedMethod

LOOKUP_BAG = 32
"""Ids per bag in the features the tables look up (``in_bags``)."""


LOOKUP_KEYS = ("item", "item_neg", "action", "user")
"""The first keys of an ``HSTUBatch``'s features, in this order: the ids the embedding tables look up."""


def sparse_features(batch: HSTUBatch, sparse_keys: int = len(LOOKUP_KEYS)) -> KeyedJaggedTensor:
    """The ids the EmbeddingCollection embeds (the batch's first four keys: item, item_neg, action, user)
    in bags of at most ``LOOKUP_BAG`` (``in_bags``; ``HSTURecommender.sparse_features`` puts the item
    table under item_neg for the full softmax)."""
    keys = batch.features.keys()
    return in_bags(batch.features.split([sparse_keys, len(keys) - sparse_keys])[0], LOOKUP_BAG)


def in_bags(features: KeyedJaggedTensor, bag: int) -> KeyedJaggedTensor:
    """The same ids in the same order, each key's split evenly over as many bags (the KJT's stride) as the
    longest key needs for at most ``bag`` ids per bag. The lookup gives every id its own row in the order
    of the values whatever the bags, and the model reads only the values; but fbgemm's sequence lookup and
    TorchRec's row-wise bucketize walk each bag's ids one after another in one warp, so a batch's longest
    history set their time: with histories of up to 4096 events they took 2.0 and 1.5 ms per step of an
    H200, and in bags of 32 the step's kernels took 4.2 ms less (BENCHMARKS.md). Uses the per-key counts
    the KJT knows (no host sync); one that does not know them is returned as it is. The bags' lengths are
    built by numpy from those counts (about 5 us on the host, where a dozen small tensor operations took
    about 21 us) and reach the device in one copy from pinned memory."""
    per_key = features.length_per_key_or_none()
    if per_key is None:
        return features
    bags = max(1, *(-(-n // bag) for n in per_key))
    runs = [divmod(n, bags) for n in per_key]  # n ids over ``bags`` bags: the first n % bags get one more
    sizes = np.array([size for each, _ in runs for size in (each + 1, each)], dtype=np.int64)
    spread = torch.from_numpy(np.repeat(sizes, [count for _, more in runs for count in (more, bags - more)]))
    lengths = features.lengths()
    spread = spread.to(lengths.dtype)
    if lengths.is_cuda:
        spread = spread.pin_memory()
    return KeyedJaggedTensor(
        keys=features.keys(),
        values=features.values(),
        lengths=spread.to(lengths.device, non_blocking=True),
        stride=bags,
        length_per_key=per_key,
    )


def global_tokens(batch: HSTUBatch) -> torch.Tensor | float:
    """The token count of every rank's batch together, all-reduced; stays a tensor (no host sync). On one
    rank, where the batch's KeyedJaggedTensor knows its per-key counts on the host (the loader's batches
    do), that count as a number: no collective and no PyTorch call."""
    if dist.get_world_size() == 1:
        per_key = batch.features.length_per_key_or_none()
        if per_key is not None and (count := per_key[batch.features.keys().index(batch.sequence_keys[0])]) > 0:
            return float(count)
    tokens = batch.sequence_lengths().sum().to(torch.float32)
    if dist.get_world_size() > 1:
        dist.all_reduce(tokens)
    return tokens


def global_token_scale(tokens: torch.Tensor | float) -> torch.Tensor | float:
    """Factor for a rank's summed loss so that the data-parallel mean over ranks is the loss of the whole
    global batch per token (``tokens``: the all-reduced token count)."""
    return dist.get_world_size() / tokens


def dense_losses(
    objectives: nn.Module, batch: HSTUBatch, embeddings, graphed: GraphedMethod | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed retrieval and ranking losses; through ``graphed`` (``objectives.losses`` on inputs of
    static shapes: padded to the model's length, or jagged, grown to a token capacity) when given."""
    if graphed is None:
        return objectives(batch, embeddings)
    inputs = objectives.dense_inputs(batch, embeddings, static=True)
    rows, grown = objectives.graph_growth(inputs)
    return graphed(*inputs, rows=rows, grown=grown)


def global_token_loss(
    objectives: nn.Module, batch: HSTUBatch, embeddings, tokens: torch.Tensor, graphed: GraphedMethod | None = None
) -> torch.Tensor:
    """The rank's loss, scaled by ``global_token_scale``, as ``HSTURecommender.training_step`` computes it."""
    retrieval, ranking = dense_losses(objectives, batch, embeddings, graphed)
    return (retrieval + ranking) * global_token_scale(tokens)
