"""Data under faults: ids outside their embedding table are refused with the feature, the id and the table
size (never looked up as row 0), and MovieLens files that are truncated, empty, HTML or binary are refused
naming the file and line; the first-use download takes a wheel only, checks its SHA-256, and runs once
while other processes wait."""

import lightning.pytorch as pl
import pytest
import torch
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ranks import run_on_ranks
from small_hstu import SMALL_MODEL, small_data

from lightning_hstu import HSTUPipelineStrategy
from lightning_hstu.data.histories import History, HistoryDataModule
from lightning_hstu.hstu.batch import IdError
from lightning_hstu.hstu.sparse import ShardedEmbeddings
from lightning_hstu.models.hstu import HSTURecommender


def fit_hstu(model_kwargs=None, data=None):
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(strategy=HSTUPipelineStrategy("default_d6"), accelerator="cpu", devices=1, max_steps=4,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(HSTURecommender(**{**SMALL_MODEL, **(model_kwargs or {})}), data or small_data())


# ----- ids outside their table ---------------------------------------------------------------------------------

class CraftedHistories(HistoryDataModule):
    """Twenty users of four events; user 7's third item id is ``bad_item``."""

    def __init__(self, bad_item: int):
        super().__init__(batch_size=4, max_seq_len=8, negatives=2)
        self.bad_item = bad_item

    def load(self):
        histories = []
        for user in range(1, 21):
            items = (1 + user % 9, 2, self.bad_item if user == 7 else 3, 4)
            histories.append(History(user, items, (1, 2, 3, 4), (10, 20, 30, 40)))
        return histories


def test_a_negative_item_id_in_the_data_is_refused_where_the_batch_is_built():
    data = CraftedHistories(bad_item=-3)
    data.setup()
    with pytest.raises(IdError) as info:
        list(data.train_dataloader())
    message = str(info.value)
    assert "feature 'item' has id -3" in message and "user 7" in message
    assert f"table of {data.num_items + 1} rows" in message


def test_a_fit_on_data_with_a_bad_id_stops_there():
    with pytest.raises(IdError, match="feature 'item' has id -3"):
        fit_hstu(data=CraftedHistories(bad_item=-3))


def test_a_model_whose_item_table_is_smaller_than_the_data_is_refused():
    data = small_data()
    with pytest.raises(IdError) as info:
        fit_hstu(model_kwargs={"num_items": 50}, data=data)
    assert "num_items=50" in str(info.value) and f"{data.num_items}" in str(info.value)


def _lookup_out_of_range(rank, world):
    table = EmbeddingConfig(name="item", embedding_dim=4, num_embeddings=10, feature_names=["item"])
    embeddings = ShardedEmbeddings([table], torch.device("cpu"))
    outcome = {}
    for ids in ([1, 2, 12], [1, -3, 2]):
        features = KeyedJaggedTensor.from_lengths_sync(keys=["item"], values=torch.tensor(ids),
                                                       lengths=torch.tensor([1, 2]))
        try:
            embeddings(features)
            outcome[f"checked {ids}"] = "looked up"
        except IdError as error:
            outcome[f"checked {ids}"] = str(error)
        try:  # past our check: fbgemm's own bounds check must fail, not look up row 0
            embeddings.model_parallel(features)
            outcome[f"fbgemm {ids}"] = "looked up"
        except RuntimeError as error:
            outcome[f"fbgemm {ids}"] = str(error)
    return outcome


def test_the_lookup_refuses_ids_outside_the_table(tmp_path):
    (outcome,) = run_on_ranks(_lookup_out_of_range, tmp_path, world=1)
    assert "feature 'item' has id 12 (sample 1)" in outcome["checked [1, 2, 12]"]
    assert "table of 10 rows" in outcome["checked [1, 2, 12]"]
    assert "feature 'item' has id -3 (sample 1)" in outcome["checked [1, -3, 2]"]
    assert outcome["fbgemm [1, 2, 12]"] != "looked up" and outcome["fbgemm [1, -3, 2]"] != "looked up"
