"""On two gloo ranks, the engine's losses and weights equal TorchRec's own TrainPipelineSparseDist on the same
model and batches (identity shuffler), for several presets.

Both runs share one model: the HSTU objectives (dense, data-parallel through megatron-core) and the
sharded embeddings (fused SGD in backward), reset to the same initial weights before each run.
"""

import pytest
import torch
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from hstu_baselines import FinalizingOptimizer, PipelineBatch, PipelineModel, engine_bodies
from ranks import run_on_ranks
from small_hstu import SMALL_MODEL, small_data

from lightning_hstu import Engine, get_plan
from lightning_hstu.hstu.dense_grads import MegatronDenseGrads
from lightning_hstu.hstu.shuffler import BalancedShuffler
from lightning_hstu.hstu.sparse import ShardedEmbeddings
from lightning_hstu.models.hstu import HSTURecommender, embedding_tables

PRESETS = ("legacy_none", "default_d6", "full_split_d3")
STEPS = 6


def weights(model: HSTURecommender):
    dense = {k: v.detach().clone() for k, v in model.objectives.state_dict().items()}
    sparse = {k: v.detach().clone() for k, v in model.embeddings.local_weights().items()}
    return dense, sparse


def restore(model: HSTURecommender, saved) -> None:
    dense, sparse = saved
    model.objectives.load_state_dict(dense)
    with torch.no_grad():
        for k, v in model.embeddings.local_weights().items():
            v.copy_(sparse[k])


def _compare(rank, world):
    data = small_data()
    data.setup()
    batches = list(data.train_dataloader())[rank::world][:STEPS]  # the same order on every rank: seeded
    torch.manual_seed(0)
    # sampled: TorchRec's pipeline looks up the batch's own features (no item table under item_neg)
    model = HSTURecommender(
        **SMALL_MODEL, num_items=data.num_items, num_users=data.num_users, num_actions=5, retrieval_loss="sampled"
    )
    tables = embedding_tables(SMALL_MODEL["embedding_dim"], data.num_items, data.num_users, 5)
    model.embeddings = ShardedEmbeddings(tables, torch.device("cpu"), optimizer_kwargs={"lr": 0.1})
    model.dense_grads = MegatronDenseGrads(model.objectives)
    model.shuffler = BalancedShuffler(data.batch_size, enabled=False)  # the pipeline has no shuffler
    initial = weights(model)
    results = {}
    for preset in PRESETS:
        restore(model, initial)
        losses = []
        optimizer = torch.optim.SGD(model.objectives.parameters(), lr=0.05)
        with Engine(get_plan(preset), engine_bodies(model, optimizer, losses)) as engine:
            engine.run(batches)
        results[preset] = ([float(loss) for loss in losses], weights(model))
    restore(model, initial)
    optimizer = FinalizingOptimizer(torch.optim.SGD(model.objectives.parameters(), lr=0.05), model.dense_grads)
    pipeline = TrainPipelineSparseDist(PipelineModel(model), optimizer, torch.device("cpu"))
    iterator = iter([PipelineBatch.of(b) for b in batches])
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
