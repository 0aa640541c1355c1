"""On two gloo ranks, the engine's losses and weights equal TorchRec's own TrainPipelineSparseDist on the same
model and batches (identity shuffler), for several presets.

Both runs share one model: the HSTU objectives (dense, data-parallel through megatron-core) and the
sharded embeddings (fused SGD in backward), reset to the same initial weights before each run.
"""

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from ranks import run_on_ranks
from test_hstu_model import SMALL_MODEL, small_data

from lightning_hstu import Engine, get_plan
from lightning_hstu.hstu.batch import HSTUBatch
from lightning_hstu.hstu.dense_grads import MegatronDenseGrads
from lightning_hstu.hstu.shuffler import BalancedShuffler
from lightning_hstu.hstu.sparse import ShardedEmbeddings
from lightning_hstu.models.hstu import HSTURecommender, embedding_tables, sparse_features

PRESETS = ("legacy_none", "default_d6", "full_split_d3")
STEPS = 6


@dataclass
class PipelineBatch(Pipelineable):
    """What TorchRec's pipeline wants: the embedding features as an attribute it can trace."""

    sparse: KeyedJaggedTensor
    full: HSTUBatch

    def to(self, device, non_blocking=False):
        return PipelineBatch(self.sparse.to(device, non_blocking=non_blocking), self.full.to(device, non_blocking))

    def record_stream(self, stream):
        self.sparse.record_stream(stream)
        self.full.record_stream(stream)

    def pin_memory(self):
        return PipelineBatch(self.sparse.pin_memory(), self.full.pin_memory())


class GlobalTokenLoss(nn.Module):
    """The dense step of the reference: objectives, normalised by the all-reduced token count. Holds no
    sharded module, so TorchRec's tracer calls it as a leaf."""

    def __init__(self, objectives):
        super().__init__()
        self.objectives = objectives

    def forward(self, batch: HSTUBatch, embeddings):
        tokens = batch.sequence_lengths().sum().to(torch.float32)
        dist.all_reduce(tokens)
        retrieval, ranking = self.objectives(batch, embeddings)
        return (retrieval + ranking) * dist.get_world_size() / tokens


class Reference(nn.Module):
    def __init__(self, embeddings: ShardedEmbeddings, loss: GlobalTokenLoss):
        super().__init__()
        self.sparse, self.loss = embeddings.model_parallel, loss

    def forward(self, batch: PipelineBatch):
        loss = self.loss(batch.full, self.sparse(batch.sparse))
        return loss, loss.detach()


class FinalizingSGD(torch.optim.SGD):
    """The pipeline calls zero_grad and step: megatron-core's buffers are cleared and reduced there."""

    def __init__(self, params, grads: MegatronDenseGrads, lr):
        super().__init__(params, lr=lr)
        self.grads = grads

    def zero_grad(self, set_to_none=True):
        self.grads.zero_grad()

    def step(self, closure=None):
        self.grads.finalize()
        return super().step(closure)


def engine_bodies(model: HSTURecommender, optimizer, losses: list):
    def h2d(b):
        b["device_batch"] = b["batch"]

    def zero_grad(b):
        optimizer.zero_grad()
        b["grads_cleared"] = True

    def forward(b):
        retrieval, ranking = model.objectives(b["shuffled_batch"], b["embeddings"])
        b["loss"] = (retrieval + ranking) * dist.get_world_size() / b["global_tokens"]

    def backward(b):
        b["loss"].backward()
        b["grads"] = True

    def optimizer_step(b):
        torch.optim.SGD.step(optimizer)  # gradients were finalised by their own task
        b["stepped"] = True

    def watchdog(b):
        losses.append(float(b["loss"]))

    return {"h2d": h2d, "start_shuffle": model.hstu_start_shuffle, "finish_shuffle": model.hstu_finish_shuffle,
            "start_input_dist": model.hstu_start_input_dist, "wait_input_dist": model.hstu_wait_input_dist,
            "prefetch_embeddings": model.hstu_prefetch_embeddings, "zero_grad": zero_grad,
            "global_tokens_allreduce": model.hstu_global_tokens_allreduce,
            "compute_output_dist": model.hstu_compute_output_dist, "forward": forward, "backward": backward,
            "finalize_model_grads": model.hstu_finalize_model_grads, "optimizer_step": optimizer_step,
            "watchdog": watchdog}


def weights(model: HSTURecommender):
    dense = {k: v.detach().clone() for k, v in model.objectives.state_dict().items()}
    sparse = {k: v.local_shards()[0].tensor.detach().clone()
              for k, v in model.embeddings.model_parallel.state_dict().items()}
    return dense, sparse


def restore(model: HSTURecommender, saved) -> None:
    dense, sparse = saved
    model.objectives.load_state_dict(dense)
    with torch.no_grad():
        for k, v in model.embeddings.model_parallel.state_dict().items():
            v.local_shards()[0].tensor.copy_(sparse[k])


def _compare(rank, world):
    data = small_data()
    data.setup()
    batches = list(data.train_dataloader())[rank::world][:STEPS]  # the same order on every rank: seeded
    torch.manual_seed(0)
    model = HSTURecommender(**SMALL_MODEL, num_items=data.num_items, num_users=data.num_users, num_actions=5)
    tables = embedding_tables(SMALL_MODEL["embedding_dim"], data.num_items, data.num_users, 5)
    model.embeddings = ShardedEmbeddings(tables, torch.device("cpu"), optimizer_kwargs={"lr": 0.1})
    model.dense_grads = MegatronDenseGrads(model.objectives)
    model.shuffler = BalancedShuffler(data.batch_size, enabled=False)  # the pipeline has no shuffler
    initial = weights(model)
    results = {}
    for preset in PRESETS:
        restore(model, initial)
        losses = []
        optimizer = FinalizingSGD(model.objectives.parameters(), model.dense_grads, lr=0.05)
        with Engine(get_plan(preset), engine_bodies(model, optimizer, losses)) as engine:
            engine.run(batches)
        results[preset] = (losses, weights(model))
    restore(model, initial)
    optimizer = FinalizingSGD(model.objectives.parameters(), model.dense_grads, lr=0.05)
    pipeline = TrainPipelineSparseDist(Reference(model.embeddings, GlobalTokenLoss(model.objectives)), optimizer,
                                       torch.device("cpu"))
    iterator = iter([PipelineBatch(sparse_features(b), b) for b in batches])
    losses = []
    while True:
        try:
            losses.append(float(pipeline.progress(iterator)))  # the model output: its detached loss
        except StopIteration:
            break
    results["TrainPipelineSparseDist"] = (losses, weights(model))
    return results


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    return run_on_ranks(_compare, tmp_path_factory.mktemp("vs_torchrec"))


@pytest.mark.parametrize("preset", PRESETS)
def test_the_engine_matches_torchrecs_pipeline(preset, compared):
    for rank in compared:
        expected_losses, (expected_dense, expected_sparse) = rank["TrainPipelineSparseDist"]
        losses, (dense, sparse) = rank[preset]
        assert len(expected_losses) == STEPS
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        for name, value in expected_dense.items():
            torch.testing.assert_close(dense[name], value, rtol=1e-5, atol=1e-6)
        for name, value in expected_sparse.items():
            torch.testing.assert_close(sparse[name], value, rtol=1e-5, atol=1e-6)
    start = compared[0]["TrainPipelineSparseDist"][0]
    assert start[-1] != start[0]  # training moved: the comparison is not of untouched weights
