"""Two gloo ranks train what one process trains on their batches put together: the balanced shuffler moves
samples between the ranks, the loss is normalised by the global token count, megatron-core averages the
dense gradients and TorchRec's all-to-all backward the table gradients, so the weights after several steps
equal (within float rounding) those of one process training each step's global batch, with and without
the shuffler."""

import sys
from pathlib import Path

import pytest
import torch

from ranks import run_on_ranks
from small_hstu import SMALL_MODEL, small_data

from lightning_hstu import Engine, get_plan
from lightning_hstu.hstu.batch import HSTUBatch
from lightning_hstu.hstu.dense_grads import MegatronDenseGrads
from lightning_hstu.hstu.shuffler import BalancedShuffler
from lightning_hstu.hstu.sparse import ShardedEmbeddings
from lightning_hstu.models.hstu import HSTURecommender, embedding_tables

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from hstu_baselines import engine_bodies  # noqa: E402

STEPS = 4


def _train(rank, world, shuffle):
    """STEPS steps of default_d6: on two ranks rank r trains loader batch 2k + r at step k; on one, both."""
    data = small_data()
    data.setup()
    batches = list(data.train_dataloader())
    if world == 1:
        mine = [HSTUBatch.concat(batches[2 * k : 2 * k + 2]) for k in range(STEPS)]
    else:
        mine = [batches[2 * k + rank] for k in range(STEPS)]
    torch.manual_seed(0)
    model = HSTURecommender(**SMALL_MODEL, num_items=data.num_items, num_users=data.num_users, num_actions=5)
    tables = embedding_tables(SMALL_MODEL["embedding_dim"], data.num_items, data.num_users, 5)
    model.embeddings = ShardedEmbeddings(tables, torch.device("cpu"), optimizer_kwargs={"lr": 0.1})
    with torch.no_grad():  # the same tables on one rank (whole) and on two (row-wise halves)
        rows = {table.name: table.num_embeddings for table in tables}
        for name, shard in model.embeddings.local_weights().items():  # embeddings.<table>.weight
            table_rows = rows[name.split(".")[-2]]
            whole = torch.randn(table_rows, shard.shape[1], generator=torch.Generator().manual_seed(7))
            block = -(-table_rows // world)
            shard.copy_(whole[rank * block : rank * block + shard.shape[0]])
    model.dense_grads = MegatronDenseGrads(model.objectives)
    model.shuffler = BalancedShuffler(mine[0].size, enabled=shuffle)
    optimizer = torch.optim.SGD(model.objectives.parameters(), lr=0.05)
    with Engine(get_plan("default_d6"), engine_bodies(model, optimizer, [])) as engine:
        engine.run(mine)
    dense = {k: v.detach().clone() for k, v in model.objectives.state_dict().items()}
    sparse = {k: v.detach().clone() for k, v in model.embeddings.local_weights().items()}
    return dense, sparse, model.shuffler.active


def _both(rank, world):
    return {shuffle: _train(rank, world, shuffle) for shuffle in (False, True)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    one = run_on_ranks(_both, tmp_path_factory.mktemp("one"), world=1)[0]
    return one, run_on_ranks(_both, tmp_path_factory.mktemp("two"), world=2)


@pytest.mark.parametrize("shuffle", [False, True])
def test_two_ranks_train_the_weights_one_process_trains_on_the_global_batches(shuffle, trained):
    one, two = trained
    dense, sparse, _ = one[shuffle]
    for rank in two:
        for name, value in dense.items():
            torch.testing.assert_close(rank[shuffle][0][name], value, rtol=1e-4, atol=1e-6)
    for name, value in sparse.items():  # the row-wise halves, put together, are the one process's table
        torch.testing.assert_close(torch.cat([rank[shuffle][1][name] for rank in two]), value, rtol=1e-4, atol=1e-6)
    assert two[0][shuffle][2] == shuffle  # the shuffler exchanged samples between the ranks (when on)
